"""Calibration of OSCAR rotations from a real model, and rotation files."""
