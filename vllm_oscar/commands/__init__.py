"""Subcommands of `vllm-oscar` (see vllm_oscar.cli.COMMANDS)."""
