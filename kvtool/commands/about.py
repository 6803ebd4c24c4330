"""``kvtool version``, ``kvtool env`` and ``kvtool sample``: what is installed, and where the bundled
sample capture is."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Annotated, Any

import typer

from kvtool._version import __version__
from kvtool.core.errors import UsageError
from kvtool.core.sample import SAMPLE_PATH
from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._common import console, example_epilog, make_table
from kvtool.core.progress import Progress

ORDER = 90
SHORT_HELP = "Version, environment and the bundled sample"

# distribution names whose versions `kvtool env` reports
PACKAGES = ("torch", "triton", "transformers", "flashinfer-python", "safetensors", "numpy", "typer", "rich")


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions of kvtool, Python and its libraries, and the CUDA device torch sees. torch is imported
    only when it is a CUDA build (to ask it for the device): a CPU build (``+cpu``) sees none."""
    torch_version = installed_version("torch")
    cuda, cuda_version, device = False, None, None
    if torch_version is not None and not torch_version.endswith("+cpu"):
        import torch  # deferred: only a CUDA build has a device to report

        cuda, cuda_version = torch.cuda.is_available(), torch.version.cuda
        if cuda:
            props = torch.cuda.get_device_properties(0)
            device = {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_bytes": props.total_memory, "count": torch.cuda.device_count()}
    return {
        "kvtool": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {p: installed_version(p) for p in PACKAGES},
        "cuda_available": cuda,
        "cuda_version": cuda_version,
        "device": device,
    }


def print_version(outcome: Outcome) -> None:
    console.print(f"kvtool {outcome.data['version']}", markup=False)


@declare("version", short_help="Print kvtool's version", help="Print kvtool's version (the same as `kvtool --version`).",
         epilog=example_epilog("kvtool version", "kvtool version --json"), render=print_version)
def version(*, progress: Progress) -> Outcome:
    return Outcome({"version": __version__, "python": platform.python_version()})


def print_env(outcome: Outcome) -> None:
    data = outcome.data
    dev = data["device"]
    rows = [("kvtool", data["kvtool"]), ("python", f"{data['python']} ({data['platform']})")]
    rows += [(name, v or "not installed") for name, v in data["packages"].items()]
    rows.append(("CUDA", f"{data['cuda_version']}" if data["cuda_version"] else "CPU-only torch build"))
    rows.append(("device", f"{dev['name']} (sm_{dev['capability'].replace('.', '')}, {dev['memory_bytes'] / 2**30:.1f} GiB) x{dev['count']}" if dev else "no CUDA device"))
    for k in data.get("kernels") or []:
        rows.append((f"kernel {k['name']}", f"{k['status']} ({k['seconds']:.0f} s)"))
    console.print(make_table("kvtool env", ["what", "value"], rows))


@declare("env", short_help="Versions of kvtool, Python, torch, Triton, transformers, FlashInfer; the CUDA device",
         help="What kvtool runs on: versions of kvtool, Python, torch, Triton, transformers, FlashInfer and the "
         "other libraries, and the CUDA device torch sees. Paste it into bug reports. With --build-kernels it also "
         "builds kvtool's CUDA extensions for this GPU (all at once, about a minute; once per machine, kernel version "
         "and GPU type, in $KVTOOL_CACHE/cuda-ext), so that no later command pays the build on first use.",
         epilog=example_epilog("kvtool env", "kvtool env --json", "kvtool env --build-kernels --json"), render=print_env)
def env(build_kernels: Annotated[bool, typer.Option("--build-kernels", help="Build the CUDA extensions now (or find them built); "
                                                   "exit 2 where there is no CUDA toolchain or device.")] = False,
        *, progress: Progress) -> Outcome:
    data = environment()
    if build_kernels:
        from kvtool.kernels.extensions import build_extensions, toolchain_problem  # deferred: imports torch and Triton

        problem = toolchain_problem()
        if problem:
            raise UsageError(problem)
        progress.note("building the CUDA extensions (about a minute where none is built yet)")
        data["kernels"] = build_extensions()
    return Outcome(data)


@declare("sample path", help="Print the bundled sample's path.", epilog=example_epilog("kvtool sample path", "kvtool sample path --json"),
         render=lambda outcome: sys.stdout.write(f"{outcome.data['path']}\n"),
         api=None)  # kvtool.sample_path() returns the Path itself
def path(*, progress: Progress) -> Outcome:
    return Outcome({"path": str(SAMPLE_PATH), "bytes": SAMPLE_PATH.stat().st_size})


def register(app: typer.Typer) -> None:
    add_commands(app, version, env)
    sample_app = typer.Typer(name="sample", help="The sample capture bundled with kvtool (4 layers of SmolLM2-135M, 512 tokens, "
                             "with queries and hidden states). Every command also accepts the name 'sample:' for it.",
                             no_args_is_help=True, rich_markup_mode="rich",
                             epilog=example_epilog("kvtool sample path", "kvtool sample path --json", "kvtool stats sample:",
                                                   "cp \"$(kvtool sample path)\" cap.safetensors"))
    add_commands(sample_app, path)
    app.add_typer(sample_app, name="sample", short_help="Where the bundled sample capture is ('sample:' in any command)")
