"""Run transformers' own model tests for every patch_hf family twice — as they are, and with
wiola_kernels.patch_hf applied to every model they build — and report what fails only when
patched (issue 38).

    python scripts/hf_suite.py --tests DIR [--families llama,qwen3] [-k EXPR] [--fast] [--together]
    python scripts/hf_suite.py --from-release [DIR] [--fast] [--together]

DIR is a transformers checkout (or its tests/ folder) at the commit of the installed release
(``git clone https://github.com/huggingface/transformers && git checkout v<version>``; the
wheel ships no tests). ``WIOLA_HF_TESTS_DIR`` stands in for ``--tests``. ``--from-release``
needs no checkout: the release's source archive from the package index holds its common test
mixins (``tests/test_*.py``) but no ``tests/models/``, so the tree is written around them
(:func:`build_release_tree`): transformers' ``ModelTesterMixin`` as released on a small model
of each family from wiola-kernels' own tester (``hf_suite_tester.py``). Each family's
``tests/models/<family>/test_modeling_<family>.py`` runs in its own pytest process per mode
(``--together``: every family in one process per mode), one worker, ``-p no:cacheprovider``,
RUN_SLOW unset, results read from JUnit XML. The patched
run loads scripts/hf_suite_plugin.py, which counts the patched models per test: a family whose
patched run built no patched model is reported as NOT PATCHED, never as a pass.

Exit status: 0 when no family has a failure the unpatched run lacks and every
patched run patched something; 1 otherwise; 2 for a usage error (no tests directory, ...).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from wiola_kernels.hf import _FAMILIES

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent

# model_type -> the folder of transformers' tests, which is the family's transformers package
# (patch_hf's own table: Gemma 3's text model lives, and is tested, in gemma3's).
FAMILIES = {model_type: family.module for model_type, family in _FAMILIES.items()}

# --fast: a few seconds per family that still build, run, train, save/load and compile
# patched models (CI's subset; the full files take minutes each).
FAST_K = ("test_training_gradient_checkpointing or test_save_load or test_causal_lm_can_accept_training_kwargs "
          "or test_model_rope_scaling_from_config or test_sequence_classification_model_for_single_label "
          "or test_left_padding_compatibility or test_batching_equivalence")

# --from-release: transformers' common model tests from the installed release's source archive
# (the wheel has none; the archive has tests/test_*.py but not tests/models/), each family's
# module written here around wiola-kernels' own tester (hf_suite_tester.py).
RELEASE_FAST_K = ("(test_training and not reentrant) or test_save_load or test_batching_equivalence "
                  "or test_hidden_states_output or test_inputs_embeds or test_retain_grad_hidden_states")
_STUBS = {  # modules test_modeling_common.py imports that the archive lacks: empty mixins, ours
    "generation/test_utils.py": "class GenerationTesterMixin:  # not in the source archive: no generate tests\n"
                                "    pass\n",
    "exporters/test_export.py": "class ExportTesterMixin:  # not in the source archive: no export tests\n"
                                "    pass\n",
}
_FAMILY_MODULE = '''"""Written by wiola-kernels' scripts/hf_suite.py --from-release: transformers {version}'s
ModelTesterMixin (tests/test_modeling_common.py, as released) on a small {model_type} model of
wiola-kernels' own tester (scripts/hf_suite_tester.py), not transformers' family test file."""
import unittest

from hf_suite_tester import FamilyTester, model_classes

from ...test_modeling_common import ModelTesterMixin


class {cls}CommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = model_classes({model_type!r})

    def setUp(self):
        self.model_tester = FamilyTester(self, {model_type!r})
'''


def build_release_tree(dest: Path, python: str = sys.executable) -> Path:
    """A tests tree for --tests from the installed transformers release: its source archive's
    ``tests/test_*.py`` (``pip download --no-binary :all:``, once per version into ``dest``),
    two empty mixins it imports, and a module per family (:data:`_FAMILY_MODULE`). Returns the
    tree's root; RuntimeError when the archive cannot be had."""
    import tarfile

    import transformers

    version = transformers.__version__
    root = dest / f"transformers-{version}"
    tests = root / "tests"
    if not (tests / "test_modeling_common.py").is_file():
        with tempfile.TemporaryDirectory(prefix="hf_suite_sdist_") as tmp:
            proc = subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                                   f"transformers=={version}", "-d", tmp], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            archives = list(Path(tmp).glob("transformers-*.tar.gz"))
            if proc.returncode != 0 or not archives:
                said = " | ".join(proc.stdout.strip().splitlines()[-2:]) or f"exit {proc.returncode}, no output"
                raise RuntimeError(f"pip download of transformers=={version}'s source archive failed: {said}")
            tests.mkdir(parents=True, exist_ok=True)
            prefix = f"transformers-{version}/tests/"
            with tarfile.open(archives[0]) as tar:
                for member in tar.getmembers():
                    name = member.name[len(prefix):] if member.name.startswith(prefix) else ""
                    if member.isfile() and name.endswith(".py") and "/" not in name:
                        (tests / name).write_bytes(tar.extractfile(member).read())
        if not (tests / "test_modeling_common.py").is_file():
            raise RuntimeError(f"transformers {version}'s source archive has no tests/test_modeling_common.py")
    (tests / "__init__.py").touch()
    for path, text in _STUBS.items():
        (tests / path).parent.mkdir(exist_ok=True)
        (tests / path).parent.joinpath("__init__.py").touch()
        (tests / path).write_text(text)
    (tests / "models").mkdir(exist_ok=True)
    (tests / "models" / "__init__.py").touch()
    for model_type, folder in FAMILIES.items():
        family = tests / "models" / folder
        family.mkdir(exist_ok=True)
        (family / "__init__.py").touch()
        cls = "".join(part.capitalize() for part in model_type.split("_"))
        (family / f"test_modeling_{folder}.py").write_text(
            _FAMILY_MODULE.format(version=version, model_type=model_type, cls=cls))
    return root


@dataclass
class Run:
    outcomes: dict = field(default_factory=dict)   # test id -> "passed" / "failed" / "skipped"
    patched: int = 0                               # patched models built, over all tests
    escaped: int = 0                               # family models built but not patched
    returncode: int = 0
    error: str = ""                                # why the run produced no results

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)


def tests_root(path: str | None) -> Path:
    """The folder holding ``tests/models``, or SystemExit(2) saying where to get it."""
    hint = ("transformers' tests are not in its wheel: clone https://github.com/huggingface/transformers at the "
            "installed release's tag (v{v}) and pass --tests PATH (or set WIOLA_HF_TESTS_DIR)")
    try:
        import transformers
        version = transformers.__version__
    except ImportError:
        version = "?"
    if not path:
        raise SystemExit(f"hf_suite: no tests directory given; {hint.format(v=version)}")
    root = Path(path).expanduser().resolve()
    if (root / "models").is_dir() and root.name == "tests":
        root = root.parent
    if not (root / "tests" / "models").is_dir():
        raise SystemExit(f"hf_suite: {path} has no tests/models folder; {hint.format(v=version)}")
    return root


def parse_junit(path: Path, group=None) -> Run | dict[str, Run]:
    """The outcomes and patch counts of one JUnit report; with ``group`` (classname → a key, or
    None to drop the test), one :class:`Run` per key instead."""
    runs: dict = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        key = group(classname) if group is not None else ""
        if key is None:
            continue
        run = runs.setdefault(key, Run())
        test_id = f"{classname}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        # a test reported twice (an error in teardown) keeps its worst outcome
        if run.outcomes.get(test_id) != "failed":
            run.outcomes[test_id] = outcome
        for prop in case.iter("property"):
            if prop.get("name") == "wiola_patched":
                run.patched += int(prop.get("value", 0))
            elif prop.get("name") == "wiola_unpatched":
                run.escaped += int(prop.get("value", 0))
    return runs if group is not None else runs.get("", Run())


def _pytest(root: Path, test_files: list[Path], patched: bool, k: str | None, xml: Path, timeout: float,
            python: str) -> tuple[subprocess.CompletedProcess | None, str]:
    """One pytest process over ``test_files`` writing ``xml``; (the process, why it failed)."""
    env = dict(os.environ)
    env["WIOLA_HF_SUITE_PATCH"] = "1" if patched else "0"
    env.pop("RUN_SLOW", None)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), str(REPO), str(REPO / "python"),
                                        *filter(None, [env.get("PYTHONPATH")])])
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "hf_suite_plugin", "-q", "--tb=no",
           "-W", "ignore::pytest.PytestUnknownMarkWarning", f"--junitxml={xml}", "-o", "junit_family=xunit1",
           "--rootdir", str(root), *map(str, test_files)]
    if k:
        cmd += ["-k", k]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    if not xml.is_file():
        return proc, "pytest wrote no report: " + " | ".join(proc.stdout.strip().splitlines()[-5:])
    return proc, ""


def _test_file(root: Path, folder: str) -> Path:
    return root / "tests" / "models" / folder / f"test_modeling_{folder}.py"


def run_family(root: Path, folder: str, patched: bool, k: str | None, workdir: Path, timeout: float,
               python: str) -> Run:
    """One family's file in its own pytest process (its report ``<folder>-<mode>.xml``)."""
    return run_together(root, [folder], patched, k, workdir, timeout, python, name=folder)[folder]


def run_together(root: Path, folders: list[str], patched: bool, k: str | None, workdir: Path, timeout: float,
                 python: str, name: str = "all") -> dict[str, Run]:
    """The families' files in one pytest process (``--together``: one interpreter start per
    mode instead of one per family and mode; its report ``<name>-<mode>.xml``); the results
    split by family."""
    missing = [f for f in folders if not _test_file(root, f).is_file()]
    runs = {f: Run(error=f"no {_test_file(root, f).relative_to(root)}") for f in missing}
    present = [f for f in folders if f not in missing]
    if not present:
        return runs
    xml = workdir / f"{name}-{'patched' if patched else 'unpatched'}.xml"
    proc, error = _pytest(root, [_test_file(root, f) for f in present], patched, k, xml, timeout, python)
    if error:
        return runs | {f: Run(returncode=proc.returncode if proc else 0, error=error) for f in present}
    if len(present) == 1:  # one file: every test is its family's
        by_folder = {present[0]: parse_junit(xml)}
    else:
        by_folder = parse_junit(xml, group=lambda classname: next(
            (f for f in present if f".models.{f}.test_modeling_{f}" in f".{classname}"), None))
    for f in present:
        run = by_folder.get(f, Run())
        run.returncode = proc.returncode
        if not run.outcomes:
            run.error = "no tests collected" + (f" (-k {k!r})" if k else "")
        runs[f] = run
    return runs


def report(results: dict[str, tuple[Run, Run]], out=None) -> int:
    """Print the table and the patched-only failures; return the exit status."""
    out = out or sys.stdout
    bad = False
    print(f"{'family':<12} {'unpatched p/f/s':>17} {'patched p/f/s':>17} {'models patched':>15}  verdict", file=out)
    details = []
    for family, (plain, fused) in results.items():
        cells = [f"{r.count('passed')}/{r.count('failed')}/{r.count('skipped')}" for r in (plain, fused)]
        new = sorted(t for t, o in fused.outcomes.items() if o == "failed" and plain.outcomes.get(t) != "failed")
        if plain.error or fused.error:
            verdict = "ERROR: " + (fused.error or plain.error)
            bad = True
        elif fused.patched == 0:
            verdict = "NOT PATCHED (no model of the family was patched)"
            bad = True
        elif new:
            verdict = f"{len(new)} fail only when patched"
            bad = True
        else:
            verdict = "ok"
        if fused.escaped:
            verdict += f"; {fused.escaped} family models escaped the patch"
            bad = True
        print(f"{family:<12} {cells[0]:>17} {cells[1]:>17} {fused.patched:>15}  {verdict}", file=out)
        details += [(family, t) for t in new]
    if details:
        print("\nfailing only when patched:", file=out)
        for family, test_id in details:
            print(f"  [{family}] {test_id}", file=out)
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", default=os.environ.get("WIOLA_HF_TESTS_DIR"),
                        help="transformers checkout or its tests/ folder (default: $WIOLA_HF_TESTS_DIR)")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated model types (default: all: {','.join(FAMILIES)})")
    parser.add_argument("-k", dest="k", default=None, help="pytest -k expression, applied to both runs")
    parser.add_argument("--from-release", nargs="?", const=str(REPO / ".hf-suite"), metavar="DIR",
                        help="instead of --tests: transformers' common model tests from the installed release's "
                             "source archive (downloaded once into DIR, default .hf-suite/), each family on "
                             "wiola-kernels' own tester (hf_suite_tester.py)")
    parser.add_argument("--fast", action="store_true",
                        help=f"CI's subset: -k {FAST_K!r}; with --from-release -k {RELEASE_FAST_K!r}")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run (default 3600)")
    parser.add_argument("--keep", metavar="DIR", help="write the JUnit XML files here (default: a temp dir)")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs pytest")
    parser.add_argument("--together", action="store_true",
                        help="every family in one pytest process per mode (two processes in all; CI's form)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="pytest processes at once, each one worker (default 1: a shared 2-core machine)")
    args = parser.parse_args(argv)
    try:
        root = build_release_tree(Path(args.from_release), args.python) if args.from_release else tests_root(args.tests)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"hf_suite: {e}", file=sys.stderr)
        return 2
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        print(f"hf_suite: unknown families {', '.join(unknown)} (known: {', '.join(FAMILIES)})", file=sys.stderr)
        return 2
    fast_k = RELEASE_FAST_K if args.from_release else FAST_K
    k = args.k if not args.fast else (f"({fast_k}) and ({args.k})" if args.k else fast_k)
    with tempfile.TemporaryDirectory(prefix="hf_suite_") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        tasks = [(family, patched) for family in families for patched in (False, True)]

        def run(task):
            family, patched = task
            result = run_family(root, FAMILIES[family], patched, k, workdir, args.timeout, args.python)
            print(f"hf_suite: {family} {'patched' if patched else 'unpatched'} done", file=sys.stderr, flush=True)
            return result

        if args.together:
            folders = [FAMILIES[f] for f in families]

            def run_mode(patched):
                results = run_together(root, folders, patched, k, workdir, args.timeout, args.python)
                print(f"hf_suite: every family {'patched' if patched else 'unpatched'} done", file=sys.stderr,
                      flush=True)
                return results

            with ThreadPoolExecutor(max_workers=min(2, max(1, args.jobs))) as pool:
                plain, fused = pool.map(run_mode, (False, True))
            return report({f: (plain[FAMILIES[f]], fused[FAMILIES[f]]) for f in families})
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            done = dict(zip(tasks, pool.map(run, tasks)))
        return report({family: (done[family, False], done[family, True]) for family in families})


if __name__ == "__main__":
    sys.exit(main())
