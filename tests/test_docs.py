"""The front door and the manual: README.md, the MkDocs site under docs/, the generated config reference,
and the commands they show.

- The config reference (docs/reference/config.md) is what ``python -m acco_ds.config.reference`` generates from the
  pydantic models, and every field of every model of the ``"acco"`` block has a description.
- ``mkdocs build --strict`` passes: no broken link or anchor, no page left out of the navigation (a copy
  of the site with an orphan page and a broken link is refused, so the check can fail).
- README.md stays short and starts with the two commands; its links and the docs pages' resolve on GitHub
  (files and anchors) as they do in the site.
- Every command in a fenced bash block of README.md and docs/getting-started.md is run here (the quick
  ones), or listed below as checked by hand on a date, or as pending a merge (the feature is on another
  branch). A command added to those pages and not listed here fails the test.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

import dist

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PAGES_WITH_COMMANDS = ("README.md", "docs/getting-started.md")

# Run by test_quick_commands_run_as_written / test_example_launch_runs_as_written: command -> what its
# output must show.
RUN = {
    "acco-ds plan --params 7e9 --tokens-per-step 4e6 --nodes 4 --ranks-per-node 8 --rank-flops 4e14 "
    "--inter-bandwidth 10gbit": "recommended:",
    "acco-ds report": "DeepSpeed internals  ok",
    "python -m acco_ds.ops": "acco_cpu_ops",
    "acco-ds memory --params 7e9 --gpus 8 --dtype bf16": "GB",
}
RUN_LAUNCH = {
    "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 examples/train_gpt.py "
    "--deepspeed_config configs/acco_cpu.json --steps 20": "==== summary ====",
}
# Too long for the suite (or the suite itself): run by hand on the date given, with how.
HAND_CHECKED = {
    "make test": "2026-11-26: CI runs it (.ci/run); `make -n test` checked the recipe (the whole suite is "
                 "15 min on 2 cores: too long to run again by hand for the docs)",
    "make demo": "2026-11-26: `make -o .venv/.installed demo` (the install step skipped: it was done), exit 0, "
                 "60 steps, val loss 5.478 -> 3.000",
    "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 4 examples/train_gpt.py "
    "--deepspeed_config configs/diloco_cpu.json --steps 24": "2026-11-26: exit 0, val loss 5.478 -> 3.243, 3 syncs",
    "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 4 examples/train_gpt.py "
    "--deepspeed_config configs/co2_cpu.json --steps 24": "2026-11-26: exit 0, val loss 5.478 -> 3.284, outer communication 100% hidden",
    "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 4 examples/train_gpt.py "
    "--deepspeed_config configs/edit_cpu.json --steps 24": "2026-11-26: exit 0, val loss 5.478 -> 3.195",
    "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 4 examples/train_gpt.py "
    "--deepspeed_config configs/a_edit_cpu.json --syncs 4": "2026-11-26: exit 0, 4 syncs, val loss 5.478 -> 3.709 (periods of 3 s wall time: fewer inner steps on the loaded machine than the page's 3.218)",
    "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 4 examples/train_gpt.py "
    "--deepspeed_config configs/streaming_diloco_cpu.json --steps 24": "2026-11-26: exit 0, val loss 5.478 -> 3.236, 6 fragment syncs",
    "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 examples/train_gpt.py "
    "--deepspeed_config configs/acco_cpu_int8.json --steps 20": "2026-11-26: exit 0, val loss 5.478 -> 3.278",
    "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 4 examples/train_gpt.py "
    "--deepspeed_config configs/sparseloco_cpu.json --steps 24": "2026-11-26: exit 0 (with --master_port 29671), "
    "val loss 5.478 -> 4.056, 17,612-byte payload per rank and sync",
    "OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/fsdp2_train_gpt.py "
    "--config configs/fsdp2_diloco_cpu.json --fsdp --steps 16": "2026-11-26: exit 0, val loss 5.478 -> 3.317, 2 syncs",
}
# Commands of features on other branches, until their merge: then each is run and moved to RUN (quick) or
# HAND_CHECKED (with the date).
PENDING_MERGE = {}


def shown_commands(page: str) -> list:
    """The commands in the fenced bash blocks of ``page``: continuation lines joined, comments dropped."""
    text = (ROOT / page).read_text()
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                commands.append(" ".join(line.split()))
    return commands


def all_shown_commands() -> dict:
    return {c: page for page in PAGES_WITH_COMMANDS for c in shown_commands(page)}


def command_env() -> dict:
    """The environment ``make install`` gives: its .venv's tools first on PATH, CPU ranks."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PATH"] = os.pathsep.join([str(ROOT / ".venv" / "bin"), str(BIN), env.get("PATH", "")])
    return env


# ---------------------------------------------------------------------------------------------------------
# The config reference


def test_config_reference_is_current_and_every_field_is_described():
    from acco_ds.config import reference
    assert reference.undocumented() == [], "add a description (a docstring under the field) to these fields"
    generated = reference.render()
    assert reference.PAGE.read_text() == generated, (
        f"{reference.PAGE} differs from what the models generate: run `{reference.COMMAND}`")
    # every key of every nested block is a row, with its type and default
    from acco_ds.config import ACCOConfig
    for key in ("enabled", "local_sgd.anomaly.threshold", "compression.apply_to", "fault_tolerance.merge",
                "collectives.ranks_per_node", "emulation.slow_factor"):
        assert f"| `{key}` |" in generated, key
    assert len([k for k, _, _ in reference.rows()]) > len(ACCOConfig.model_fields)
    assert '| `local_sgd.sync_every` | integer | `20` | ≥ 1 |' in generated
    assert '| `compression.dtype` | string or null | `null` | `"int8"`, `"fp8"` |' in generated
    # --check says what to do when the page is stale
    out = subprocess.run([sys.executable, "-m", "acco_ds.config.reference", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_field_without_description_is_named():
    from acco_ds.config import reference

    class Block(BaseModel):
        described: int = Field(1, description="Has one.")
        bare: int = 2

    class Top(BaseModel):
        inner: Block = Field(default_factory=Block, description="A nested block.")

    missing = [key for key, field, _ in reference.rows(Top) if not (field.description or "").strip()]
    assert missing == ["inner.bare"]


# ---------------------------------------------------------------------------------------------------------
# The site


def mkdocs_build(config: Path, site: Path):
    try:
        import mkdocs  # noqa: F401
        import material  # noqa: F401
    except ImportError as err:  # installed by `make install` (requirements-dev.txt): missing is a failure
        pytest.fail(f"{err}: mkdocs and mkdocs-material are dev requirements; run `make install` "
                    f"(pip install -r requirements-dev.txt)")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))


def test_mkdocs_build_strict(tmp_path):
    out = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    site = tmp_path / "site"
    # every page of the benchmarks and the design sections is built (strict: each is in the navigation),
    # and the benchmark pages' plots are in the site
    for section in ("benchmarks", "design"):
        for page in (ROOT / "docs" / section).glob("*.md"):
            assert (site / section / f"{page.stem}.html").is_file(), page
    assert (site / "benchmarks/results/cluster_race.png").stat().st_size > 10_000
    assert 'src="results/cluster_race.png"' in (site / "benchmarks/races.html").read_text()
    home = (site / "index.html").read_text()
    assert 'src="benchmarks/results/cluster_race.png"' in home and 'href="getting-started.html"' in home
    assert "| key |" not in (site / "reference/config.html").read_text()  # a rendered table, not text


def test_strict_build_refuses_an_orphan_page_and_a_broken_link(tmp_path):
    """The check can fail: a copy of the site with a page missing from the navigation and a dead link."""
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy2(ROOT / name, copy / name)
    for folder in ("docs", "scripts"):
        shutil.copytree(ROOT / folder, copy / folder)
    (copy / "examples/megatron").mkdir(parents=True)
    shutil.copy2(ROOT / "examples/megatron/README.md", copy / "examples/megatron/README.md")
    (copy / "benchmarks").mkdir()
    shutil.copytree(ROOT / "benchmarks/results", copy / "benchmarks/results",
                    ignore=lambda d, names: [n for n in names if not (n.endswith(".png") or (Path(d) / n).is_dir())])
    (copy / "docs/orphan.md").write_text("# Orphan\n\nSee [nothing](no-such-page.md).\n")
    out = mkdocs_build(copy / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0
    assert "orphan.md" in out.stderr and "not included in the \"nav\"" in out.stderr, out.stderr[-3000:]
    assert "no-such-page.md" in out.stderr, out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------
# The README


def github_anchors(markdown: str) -> set:
    from pymdownx.slugs import slugify
    slug = slugify(case="lower")
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    return {slug(re.sub(r"[`*]", "", h).strip(), "-") for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_is_the_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    # the two commands come first, and they exist (.ci/run calls `make test`)
    assert shown_commands("README.md")[:2] == ["make demo", "make test"]
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", make, re.M) and re.search(r"^test:", make, re.M) and re.search(r"^docs:", make, re.M)
    assert "make test" in (ROOT / ".ci/run").read_text()
    assert "![" in readme.split("## ")[0]  # the race plot in the first paragraph's section
    for mode in ("sync", "acco", "dpu", "diloco", "co2", "edit", "A-EDiT", "Streaming DiLoCo", "sparseloco"):
        assert re.search(rf"^\| [^|]*{re.escape(mode)}", readme, re.M), mode
    assert "acco-ds plan" in readme


def test_links_resolve_on_github():
    """Relative links as GitHub resolves them, in the README and every docs page (the site's own check is
    mkdocs's): the file exists and, for a Markdown file, so does the anchor."""
    bad = []
    for page in ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]:
        bad += [f"{page}: {problem}" for problem in github_link_problems(page)]
    assert not bad, bad


def github_link_problems(page: str) -> list:
    text = re.sub(r"^```.*?^```", "", (ROOT / page).read_text(), flags=re.M | re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / page).parent / path if path else ROOT / page
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in github_anchors(file.read_text()):
            bad.append(f"{target}: no such anchor")
    return bad


# ---------------------------------------------------------------------------------------------------------
# The commands shown


def test_every_shown_command_is_run_or_listed():
    shown = all_shown_commands()
    listed = {**RUN, **RUN_LAUNCH, **HAND_CHECKED, **PENDING_MERGE}
    unlisted = [f"{c} ({page})" for c, page in shown.items() if c not in listed]
    assert not unlisted, f"add these commands to RUN, HAND_CHECKED (with the date) or PENDING_MERGE: {unlisted}"
    stale = [c for c in listed if c not in shown]
    assert not stale, f"listed here but no longer shown in {PAGES_WITH_COMMANDS}: {stale}"
    assert all(re.match(r"\d{4}-\d{2}-\d{2}", how) for how in HAND_CHECKED.values())


@pytest.mark.parametrize("command", list(RUN))
def test_quick_commands_run_as_written(command):
    out = dist.run_in_session(["bash", "-c", command], timeout=120, env=command_env())
    assert RUN[command] in out.stdout + out.stderr, out.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", list(RUN_LAUNCH))
def test_example_launch_runs_as_written(command):
    # as written, but on a free port: other launches may hold the launcher's default 29500
    launch = re.sub(r"(--num_gpus \d+) ", rf"\1 --master_port {dist.free_port()} ", command, count=1)
    out = dist.run_in_session(["bash", "-c", launch], timeout=400, env=command_env())
    text = out.stdout + out.stderr
    assert RUN_LAUNCH[command] in text, text[-3000:]
    start, end = (float(x) for x in re.search(r"val loss\s*: ([\d.]+) -> ([\d.]+)", text).groups())
    assert end < start - 0.5, (start, end)  # it learned
