"""The scripts share one skeleton: `diff single_gpu.py X.py` shows what strategy X needs, no more."""

import difflib
import re
import subprocess

import pytest

from conftest import FP32, ROOT, SCRIPTS

pytestmark = pytest.mark.smoke  # seconds: every test here is in the smoke tier

SECTION = re.compile(r"^# -- (\w[\w ]*\w) -+$", re.MULTILINE)
SIBLING_IMPORT = re.compile(r"^\s*(from|import)\s+(single_gpu|dataparallel|ddp_spawn|ddp_torchrun|ddp_amp|fsdp|pipeline)\b",
                            re.MULTILINE)
# Lines changed against single_gpu.py, both sides counted, as `diff single_gpu.py X.py | grep -c '^[<>]'`.
MAX_CHANGED_LINES = {"dataparallel.py": 36, "ddp_spawn.py": 139, "ddp_torchrun.py": 109, "ddp_amp.py": 180, "fsdp.py": 345,
                     "pipeline.py": 486}
# Scripts derived from ddp_torchrun.py, and their exact diff against it.
CHANGED_FROM_DDP_TORCHRUN = {"ddp_spawn.py": 40, "ddp_amp.py": 85, "fsdp.py": 272}


def source(script):
    return (ROOT / script).read_text()


def sections(script):
    """{section name: its text}, in file order."""
    text = source(script)
    marks = list(SECTION.finditer(text))
    return {m.group(1): text[m.end(): marks[i + 1].start() if i + 1 < len(marks) else len(text)]
            for i, m in enumerate(marks)}


def changed_lines(script, against="single_gpu.py"):
    diff = subprocess.run(["diff", str(ROOT / against), str(ROOT / script)], check=False, capture_output=True, text=True)
    assert diff.returncode in (0, 1), diff.stderr
    return sum(line.startswith(("<", ">")) for line in diff.stdout.splitlines())


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_script_imports_a_sibling(script):
    assert not SIBLING_IMPORT.search(source(script))


@pytest.mark.parametrize("script", SCRIPTS)
def test_same_sections_in_the_same_order(script):
    assert list(sections(script)) == ["configuration", "data", "model", "setup", "training step", "evaluation",
                                      "checkpointing", "main"]


# Data and model: what a user replaces, in every script alike. Checkpointing: one format, so that any
# script resumes any other's (ddp_amp.py adds its scaler's state, which the others ignore; fsdp.py and pipeline.py
# write DCP directories, read checkpoint.pt too, and convert: the next test).
@pytest.mark.parametrize("script, section", [(script, section) for script in SCRIPTS[1:] for section in ("data", "model")]
                         + [(script, "checkpointing") for script in FP32[1:] if script not in ("fsdp.py", "pipeline.py")])
def test_shared_sections_are_single_gpus(script, section):
    assert sections(script)[section] == sections("single_gpu.py")[section]


def test_fsdp_and_pipeline_checkpoint_alike():
    """One DCP format, whatever each rank holds: pipeline.py's checkpointing section is fsdp.py's, but for what a stage
    needs that a shard does not. A shard's groups name every parameter; a stage's only its own, and DCP writes one
    rank's groups: pipeline.py's save writes every stage's names (`order`) into them."""
    fsdp, pipeline = sections("fsdp.py")["checkpointing"], sections("pipeline.py")["checkpointing"]
    changed = [line for line in difflib.ndiff(fsdp.splitlines(), pipeline.splitlines()) if line.startswith(("- ", "+ "))]
    assert changed == [
        "- def save_checkpoint(path, model, optimizer, scheduler, step, config, keep, writing, wait, save_group):",
        "+ def save_checkpoint(path, model, optimizer, scheduler, step, config, order, keep, writing, wait, save_group):",
        '+     for group, names in zip(state["optimizer"]["param_groups"], order):  # one rank\'s groups: every stage\'s names',
        '+         group["params"] = names']


@pytest.mark.parametrize("script", CHANGED_FROM_DDP_TORCHRUN)
def test_derived_scripts_differ_from_ddp_torchrun_only_in_their_strategy(script):
    """ddp_spawn.py is ddp_torchrun.py with another way to start the processes: the docstring, an
    import, --nproc and its GPU check, and run() with the spawn, which give each process torchrun's environment. ddp_amp.py is ddp_torchrun.py
    with autocast and a loss scaler. fsdp.py is ddp_torchrun.py with sharding for the wrap, and sharded
    checkpoints. The counts are exact, so a DDP line changed in one of them alone, or
    deleted, fails here (the tests that run them check behaviour mostly on ddp_torchrun.py)."""
    assert changed_lines(script, against="ddp_torchrun.py") == CHANGED_FROM_DDP_TORCHRUN[script]


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_diff_against_single_gpu_stays_small(script):
    assert 0 < changed_lines(script) <= MAX_CHANGED_LINES[script]


def test_readme_states_the_real_diff_sizes():
    readme = (ROOT / "README.md").read_text()
    for script in SCRIPTS[1:]:
        row = re.search(rf"^\| `{re.escape(script)}` \|.*\| (\d+) \| (\d+|-) \|$", readme, re.MULTILINE)
        assert row, f"README has no diff-size row for {script}"
        assert int(row.group(1)) == changed_lines(script), script
        against_ddp_torchrun = CHANGED_FROM_DDP_TORCHRUN.get(script) and changed_lines(script, against="ddp_torchrun.py")
        assert row.group(2) == str(against_ddp_torchrun or "-"), script
