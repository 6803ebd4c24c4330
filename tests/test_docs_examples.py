"""Every example kvtool shows parses, runs where it is CPU-sized, and uses no deprecated option.

Examples: the ``kvtool ...`` lines of every command's ``--help`` (its epilog), of the fenced blocks of
README.md and docs/*.md, and the inline `` `kvtool ...` `` mentions of the docs (tests/docs_harness.py
finds them). Each is

1. parsed as the CLI parses it (Click's types and callbacks, kvtool's argv rewriting), without running;
2. checked for deprecated options (a hidden, renamed option given a value, or ``bench --json FILE``);
3. run, in order per file in a folder seeded with ``cap.safetensors`` (a copy of the bundled sample),
   unless a rule of :data:`PARSE_ONLY` says why it cannot run here: those are checked by 1 and 2 only.
   README's lines run in tests/test_readme.py, in order, so they are not run twice.

Inline mentions are fragments (``kvtool verify --generate 8``): their options must exist on the named
command and not be deprecated.
"""

from __future__ import annotations

import re
import shlex
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import click
import pytest
from typer.testing import CliRunner

from tests.docs_harness import DOCS, FENCE, ROOT, doc_examples, help_examples, parse_only, root_command

SAMPLE = ROOT / "kvtool" / "data" / "smollm2-sample.safetensors"
FILE = re.compile(r"\.(safetensors|json|gguf|txt|csv|html|png|md)$")
OUTPUT_FLAGS = {"-o", "--output", "--out-dir", "--plot-output", "--out"}


def _value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None


def _missing_inputs(args: list[str], folder: Path) -> list[str]:
    """File arguments that are not outputs and do not exist in ``folder``."""
    outputs = {args[i + 1] for i, a in enumerate(args[:-1]) if a in OUTPUT_FLAGS}
    out = []
    for i, a in enumerate(args):
        for word in [a, a.partition("=")[2], a.partition(":")[2]]:
            if word and FILE.search(word) and word not in outputs and not (folder / word).exists() and not word.startswith("sample:"):
                out.append(word)
                break
    return out


SAMPLE_LAYERS = {0, 7, 15, 23}


def _layers_in_sample(args: list[str]) -> bool:
    """Whether every layer that ``--layers`` / ``--layer`` names is one of the sample's."""
    for flag in ("--layers", "--layer", "--query-layers"):
        value = _value(args, flag)
        if value is None:
            continue
        for part in value.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or not set(range(int(lo), int(hi or lo) + 1)) <= SAMPLE_LAYERS:
                return False
    return True


# Why an example is parsed but not run here: (test on its arguments and the example folder, reason).
PARSE_ONLY: list[tuple[Callable[[list[str], Path], bool], str]] = [
    (lambda a, d: a[0] in ("capture", "generate", "tasks"), "runs a language model (the real one or a download)"),
    (lambda a, d: a[0] == "bench" and "report" not in a, "times GPU kernels (tests/test_bench.py runs the suites on the CPU interpreter)"),
    (lambda a, d: any(v.startswith("cuda") for v in a) or "--device-map" in a, "needs a CUDA device"),
    (lambda a, d: "--build-kernels" in a, "builds the CUDA extensions (needs the CUDA toolchain and a GPU)"),
    (lambda a, d: a[0] in ("verify", "eval", "recommend", "report") and "--no-model" not in a, "scores continuations with the model"),
    (lambda a, d: a[0] == "export" and "hf" in a, "a transformers cache needs all the model's layers; the seeded capture holds 4"),
    (lambda a, d: bool(_missing_inputs(a, d)), "reads a file no earlier example of its page makes (a GPU-sized capture, a model folder, a bench file)"),
    (lambda a, d: a[0] in ("recommend", "report", "heads", "eval") and "--layers" not in a and "-h" not in a,
     "over every layer of the capture it takes minutes on one CPU core (tests/test_recommend.py, test_report.py, test_heads.py run them small)"),
    (lambda a, d: "--help" in a, "prints help"),
    (lambda a, d: a[0] == "plot" and "--all" in a and "--layers" not in a, "draws every figure of every layer and head: a minute of matplotlib (tests/test_plots.py runs --all on a small capture)"),
    (lambda a, d: not _layers_in_sample(a), "names layers the seeded capture lacks (it holds layers 0, 7, 15 and 23 of 30)"),
]


def parse_only_reason(args: list[str], folder: Path) -> str | None:
    return next((why for test, why in PARSE_ONLY if test(args, folder)), None)


_ROOT = None


def _command(args: list[str]) -> tuple[click.Command, list[str]]:
    """The command an argument list names, and its path."""
    global _ROOT
    cmd: click.Command = _ROOT or root_command()
    _ROOT = _ROOT or cmd
    path: list[str] = []
    words = [w for w in args if not w.startswith("-")]
    while isinstance(cmd, click.Group) and words:
        sub = cmd.get_command(click.Context(cmd), words[0])
        if sub is None:
            break
        path.append(words.pop(0))
        cmd = sub
    return cmd, path


def deprecated_uses(args: list[str], params: dict[str, Any]) -> list[str]:
    """The deprecated options an example uses: hidden (renamed) options with a value, ``bench --json FILE``."""
    from kvtool.cli import _bench_json_alias

    cmd, _ = _command(args)
    found = [f"--{p.name.replace('_', '-')}" for p in cmd.params
             if getattr(p, "hidden", False) and params.get(p.name) not in (None, p.default, (), [], False)]
    if _bench_json_alias(list(args)) != list(args):
        found.append(f"--json {_value(args, '--json')}")
    return found


def all_examples() -> list[tuple[str, list[str]]]:
    return [(f"{cmd} --help", args) for cmd, args in help_examples()] + [(f"{name}:{line}", args) for name, line, args in doc_examples()]


EXAMPLES = all_examples()


def test_the_harness_finds_examples_everywhere():
    sources = {where.split(":")[0] for where, _ in EXAMPLES}
    assert {"README.md", "fidelity.md", "scale.md", "benchmarks.md", "decode.md"} <= sources, sources
    assert {"compress --help", "bench attention --help", "eval --help", "tasks --help"} <= sources, sources
    assert len(EXAMPLES) > 120


def test_every_example_parses_and_uses_no_deprecated_option(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shutil.copy(SAMPLE, tmp_path / "cap.safetensors")
    problems = []
    for where, args in EXAMPLES:
        try:
            params = parse_only(args)
        except click.exceptions.Exit:  # --help, --version
            continue
        except click.ClickException as exc:
            problems.append(f"{where}: kvtool {shlex.join(args)}: {exc.format_message()}")
            continue
        for old in deprecated_uses(args, params):
            problems.append(f"{where}: kvtool {shlex.join(args)}: uses the deprecated {old}")
    capsys.readouterr()
    assert problems == [], "\n".join(problems)


def inline_mentions() -> list[tuple[str, list[str]]]:
    """`` `kvtool CMD ...` `` in the docs' prose and in every command's help text (fenced blocks left out)."""
    out = []
    texts = [(doc.name, FENCE.sub("", doc.read_text(encoding="utf-8"))) for doc in DOCS]
    from tests.docs_harness import walk_commands

    for path, cmd in walk_commands():
        pieces = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
        texts.append((" ".join(path) + " --help", "\n".join(pieces)))
    for where, text in texts:
        for m in re.finditer(r"`(kvtool [^`]+)`", text):
            try:
                words = shlex.split(m.group(1))[1:]
            except ValueError:
                continue
            if words:
                out.append((where, words))
    return out


def test_inline_mentions_name_real_current_options():
    problems = []
    root = root_command()
    root_opts = {o for p in root.params for o in getattr(p, "opts", [])}
    for where, words in inline_mentions():
        cmd, path = _command(words)
        if not path:
            continue
        known = {o: p for p in cmd.params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}
        for i, w in enumerate(words):
            flag = w.partition("=")[0]
            if not re.fullmatch(r"--?[a-z][a-z0-9-]*", flag):
                continue
            if flag not in known and flag not in root_opts and flag not in ("--help", "-h"):
                if not isinstance(cmd, click.Group):
                    problems.append(f"{where}: `kvtool {' '.join(words)}`: {' '.join(path)} has no option {flag}")
                continue
            param = known.get(flag)
            if param is not None and getattr(param, "hidden", False):
                problems.append(f"{where}: `kvtool {' '.join(words)}`: {flag} is deprecated")
        if path[0] == "bench" and "--json" in words:
            nxt = _value(words, "--json")
            if nxt and not nxt.startswith("-") and FILE.search(nxt):
                problems.append(f"{where}: `kvtool {' '.join(words)}`: --json FILE is deprecated (-o FILE)")
    assert problems == [], "\n".join(problems)


def test_no_kvtool_string_in_the_code_shows_deprecated_syntax():
    """Messages and texts the code prints (the report's kernel section, errors) show current options."""
    pattern = re.compile(r"kvtool bench [a-z]+[^\"'\n]*--json [\w./-]+\.json|kvtool bench [^\"'\n]*--plot [\w./-]+\.png|kvtool [a-z]+[^\"'\n]* --k \d")
    found = []
    for path in sorted((ROOT / "kvtool").rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:140]}")
    assert found == [], "\n".join(found)


@pytest.mark.slow
def test_cpu_sized_examples_run(tmp_path, monkeypatch):
    """Every example no PARSE_ONLY rule stops runs from a folder of its own holding cap.safetensors
    (a link to the bundled sample: layers 0, 7, 15 and 23 of the model's 30)."""
    runner = CliRunner()
    ran, failures, seconds = [], [], {}
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "cap.safetensors").symlink_to(SAMPLE)
    for n, (where, args) in enumerate(EXAMPLES):
        if where.startswith("README.md:") or parse_only_reason(args, seed):
            continue  # README's lines run in order in tests/test_readme.py
        folder = tmp_path / f"ex{n}"
        folder.mkdir()
        (folder / "cap.safetensors").symlink_to(SAMPLE)
        monkeypatch.chdir(folder)
        start = time.perf_counter()
        res = runner.invoke(app_of(), args)
        seconds[f"{where}: {shlex.join(args)}"] = time.perf_counter() - start
        ran.append(where)
        if res.exit_code != 0:
            failures.append(f"{where}: kvtool {shlex.join(args)} -> exit {res.exit_code}\n{res.output[-800:]}")
    assert failures == [], "\n\n".join(failures)
    assert len(ran) >= 15, ran  # the rules leave enough to run
    slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:3]
    print("slowest examples:", "; ".join(f"{k} {v:.1f} s" for k, v in slowest))


def app_of():
    from kvtool.cli import app

    return app


def test_help_texts_agree_with_their_defaults_and_speak_cli():
    """An option's help that names its default names the one ``--help`` shows beside it; CLI help
    speaks of options, not Python values."""
    from tests.docs_harness import walk_commands

    problems = []
    for path, cmd in walk_commands():
        for p in cmd.params:
            text = getattr(p, "help", None) or ""
            shown = p.default not in (None, False, (), []) and getattr(p, "show_default", True) is not False
            if shown and re.search(r"default:", text) and str(p.default) not in text:
                problems.append(f"{' '.join(path)} {p.opts[0]}: help says {text!r} beside [default: {p.default}]")
            if re.search(r"\bin Python\b|\bPython:", text):
                problems.append(f"{' '.join(path)} {p.opts[0]}: help speaks of Python: {text!r}")
    assert problems == [], "\n".join(problems)


def test_public_namespace_and_api_docs():
    """``dir(kvtool)`` is ``__all__``; no function's docs send readers to a private name; a capture
    parameter is typed as what it takes."""
    import inspect

    import kvtool

    assert dir(kvtool) == sorted(kvtool.__all__)
    stray = [n for n, v in vars(kvtool).items() if not n.startswith("_") and n not in kvtool.__all__ and not inspect.ismodule(v)]
    assert stray == [], stray
    for name in kvtool.__all__:
        obj = getattr(kvtool, name)
        doc = inspect.getdoc(obj) or ""
        assert not re.search(r"kvtool\.[\w.]*\._\w+", doc), f"kvtool.{name}'s docs name a private function"
    capture = inspect.signature(kvtool.compress).parameters["capture"].annotation
    assert "KVCache" in str(capture) and "str" in str(capture)
    assert "model=False" in kvtool.verify.__doc__ and "--no-model" not in kvtool.verify.__doc__
