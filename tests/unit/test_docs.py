"""The docs stay true: generated pages are current, every relative link and anchor resolves, and
every code path, flag, function and config setting a page names exists.

What counts as a name (outside the generated pages):
- a path in backticks or in a code block whose first part is a folder of this repository
  (`fsdp_rlhf/x.py`, `examples/*.sh`) or of the package (`models/packing.py`), or a bare
  `name.py` on a line about our code: the file or folder must exist (globs and `{a,b}` must
  match). A path written right after another project's name (OpenRLHF's `examples/...`) is
  theirs and is not checked;
- every `--flag` in README.md and docs/ (code blocks included): a flag of one of our commands,
  a foreign spelling the translation layer answers for, a flag of our scripts, or of the
  launchers around us (torchrun, Slurm, pip, docker);
- a dotted name in backticks that starts in the package (`rollout.memory_budget.x`,
  `fsdp_rlhf.data.sources`): the module and attribute exist; else a dotted config path
  (`ckpt.save_hf_ckpt`) must be a setting of some command;
- on a line that names our `.py` files, a backticked `ClassName` or `function()`: defined in one
  of them.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "fsdp_rlhf"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
GENERATED = ("configuration.md", "migrating_from_openrlhf.md", "compatibility.md")
# the projects whose own paths and names our docs quote
FOREIGN = re.compile(r"(OpenRLHF|AIAK|verl|TRL|torchtitan|torchtune|vLLM's|HF's)[^`]{0,60}$")
# flags of the tools around us that the docs show in command lines
TOOL_FLAGS = {
    "torchrun": "nnodes nproc_per_node node_rank master_addr master_port rdzv_backend "
    "rdzv_endpoint rdzv_id max_restarts",
    "slurm": "nodes gpus_per_node cpus_per_task signal requeue kill_on_bad_exit batch",
    "pip": "no_index no_deps no_compile target only_binary python_version platform",
    "docker": "build_arg",
    "uv": "compile_bytecode",  # make install's uv calls (Makefile)
    "pytest": "suites",  # tests/conftest.py's option (tests/suites.py)
}


def test_generated_pages_are_current():
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.gen_docs", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors (lower case, punctuation dropped, spaces to dashes) and the
    page's own ``<a id="...">`` anchors (the generated rules table's rows)."""
    out = set(re.findall(r'<a id="([\w-]+)"></a>', path.read_text()))
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        text = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        out.add(text)
    return out


def _docs() -> list[Path]:
    return [
        REPO / "README.md",
        *sorted((REPO / "docs").rglob("*.md")),
        *sorted((REPO / "benchmarks").rglob("*.md")),
    ]


def _living_docs() -> list[Path]:
    """README and docs/ minus the generated pages: dated benchmark reports keep the flags of
    their day, so only their paths are checked."""
    return [d for d in _docs() if d.parent != REPO / "benchmarks" and d.name not in GENERATED]


def _rel(doc: Path) -> str:
    return doc.relative_to(REPO).as_posix()


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in _docs():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{_rel(doc)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_rel(doc)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_docs_exist():
    assert (REPO / "docs").is_dir() and len(_docs()) > 3


# ---------------------------------------------------------------- names in the text


def _spans(doc: Path, code_blocks: bool = False) -> list[tuple[int, str, str]]:
    """(line number, backticked text, the line before it) of every inline code span outside
    fenced code blocks; with ``code_blocks``, also each word of the code blocks' lines."""
    out, in_code = [], False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            if code_blocks:
                out += [(n, m.group(), line[: m.start()]) for m in re.finditer(r"\S+", line)]
            continue
        for m in re.finditer(r"`([^`\n]+)`", line):
            out.append((n, m.group(1), line[: m.start()]))
    return out


def _tracked() -> list[str]:
    proc = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    files = proc.stdout.split()
    if not files:  # not a git checkout (an exported tree): whatever is on disk
        files = [p.relative_to(REPO).as_posix() for p in REPO.rglob("*") if p.is_file()]
    return files


TRACKED = _tracked()
TOP_DIRS = {f.split("/")[0] for f in TRACKED if "/" in f} - {".ci"}
PKG_ENTRIES = {p.name.removesuffix(".py") for p in PKG.iterdir() if p.name != "__pycache__"}
BASENAMES = {f.rsplit("/", 1)[-1] for f in TRACKED}


def _braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [
        x
        for alt in m.group(1).split(",")
        for x in _braces(pattern[: m.start()] + alt + pattern[m.end() :])
    ]


def _path_problem(token: str, bare: bool = False) -> str | None:
    """Why ``token`` names a path of ours that does not exist; None when it exists or is not
    one of our paths. ``bare``: a lone ``name.py`` counts as ours (the line is about our
    code)."""
    token = token.rstrip(".,:;").split("#")[0]
    if " " in token or not re.fullmatch(r"[\w./*{},-]+", token):
        return None
    first = token.split("/")[0]
    if "/" in token and first in TOP_DIRS:
        base, shown = REPO, ""
    elif "/" in token and first in PKG_ENTRIES and token.endswith((".py", "/")):
        base, shown = PKG, "fsdp_rlhf/"  # metric names (rollout/...) are not paths
    elif bare and "/" not in token and re.fullmatch(r"[a-z_]\w*\.py", token):
        return None if token in BASENAMES else "no file of that name"
    else:
        return None
    for pattern in _braces(token.rstrip("/")):
        found = list(base.glob(pattern)) if "*" in pattern else [base / pattern]
        if not any(p.exists() for p in found):
            return f"no {shown}{pattern}"
    return None


# Files moved since a dated benchmark report named them (the report keeps the path of its day;
# the file must exist under its new path). Issue #47's layout: one folder per feature.
MOVED_SINCE_REPORTED = {
    "fsdp_rlhf/rollout/vllm_engine.py": "fsdp_rlhf/rollout/vllm/engine.py",
    "fsdp_rlhf/trainers/ppo_setup.py": "fsdp_rlhf/trainers/ppo/setup.py",
}


def test_every_path_a_page_names_exists():
    bad = []
    for doc in _docs():
        if doc.name in GENERATED:
            continue
        dated = doc.parent == REPO / "benchmarks"
        spans = _spans(doc, code_blocks=True)
        ours = {n for n, span, _ in spans if re.match(r"fsdp_rlhf/|[a-z_]+/\w+\.py", span)}
        for n, span, before in spans:
            if FOREIGN.search(before):
                continue
            for token in span.replace(",", " ").split():
                if dated and token in MOVED_SINCE_REPORTED:
                    token = MOVED_SINCE_REPORTED[token]
                if problem := _path_problem(token, bare=n in ours):
                    bad.append(f"{_rel(doc)}:{n}: `{token}`: {problem}")
    assert not bad, "\n".join(bad)


def _known_flags() -> set[str]:
    from fsdp_rlhf.commands import WITH_OWN_FLAGS
    from fsdp_rlhf.compat import EXPERT_PARALLEL_FLAGS
    from fsdp_rlhf.compat.openrlhf import TABLES
    from fsdp_rlhf.config_base import flag_names

    known = {"config", "debug", "help", "local_rank"}
    for command in WITH_OWN_FLAGS:
        for name, leaves in flag_names(command.config_class()).items():
            known.add(name)
            if leaves[0].type is bool:
                known.add(f"no_{name}")
    for table in TABLES.values():  # foreign spellings we translate, accept or refuse
        known |= set(table.rules)
    known |= set(EXPERT_PARALLEL_FLAGS)  # other trainers' spellings, refused by name
    for f in (PKG / "compat" / "data").glob("*.json"):
        for flag in json.loads(f.read_text())["flags"]:
            known |= {n.lstrip("-").replace("-", "_") for n in flag["names"]}
    scripts = [
        *REPO.glob("scripts/**/*.py"),
        *REPO.glob("cmd/*.py"),
        *REPO.glob("tests/cluster/*.py"),
    ]
    for f in scripts:
        found = re.findall(r'add_argument\(\s*"--([\w-]+)"', f.read_text())
        known |= {name.replace("-", "_") for name in found}
    for names in TOOL_FLAGS.values():
        known |= set(names.split())
    return known


def test_every_flag_a_page_names_exists():
    known = _known_flags()
    bad = []
    for doc in _living_docs():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for flag in re.findall(r"(?<![\w#-])--([A-Za-z][\w.-]*\w)", line):
                if flag.replace("-", "_") not in known:
                    bad.append(f"{_rel(doc)}:{n}: --{flag}")
    assert not bad, "\n".join(bad)


def _config_paths() -> set[str]:
    from fsdp_rlhf.commands import WITH_OWN_FLAGS
    from fsdp_rlhf.config_base import iter_leaves

    return {leaf.path for c in WITH_OWN_FLAGS for leaf in iter_leaves(c.config_class())}


def _resolves(dotted: str) -> bool:
    """``dotted`` (without ``fsdp_rlhf.``) is a module of the package, or an attribute path
    inside one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(["fsdp_rlhf", *parts[:cut]]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_a_page_names_exists():
    settings = _config_paths()
    bad = []
    for doc in _living_docs():
        for n, span, before in _spans(doc):
            m = re.fullmatch(r"(?:fsdp_rlhf\.)?([a-z_]\w*(?:\.\w+)+)(\(\))?", span)
            if (
                m is None
                or FOREIGN.search(before)
                or re.search(r"\.(\w{2,5})$", span)
                and (
                    span.rsplit(".", 1)[1] in ("py", "md", "json", "jsonl", "yaml", "toml", "conf")
                )
            ):
                continue
            dotted = m.group(1)
            if dotted.split(".")[0] not in PKG_ENTRIES and dotted not in settings:
                if not span.startswith("fsdp_rlhf."):
                    continue  # torch.compile, nn.functional.linear: not ours
            if not (_resolves(dotted) or dotted in settings):
                bad.append(f"{_rel(doc)}:{n}: `{span}`")
    assert not bad, "\n".join(bad)


def _defined(path: Path) -> set[str]:
    """Names a module defines at top level and in its classes."""
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    out: set[str] = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.add(node.name)
            elif isinstance(node, ast.Assign):
                out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def test_every_function_and_class_a_page_names_beside_its_file_exists():
    bad = []
    for doc in _living_docs():
        by_line: dict[int, list[str]] = {}
        for n, span, _ in _spans(doc):
            by_line.setdefault(n, []).append(span)
        for n, spans in by_line.items():
            files = [REPO / s.rstrip("/") for s in spans if s.startswith("fsdp_rlhf/")]
            files = [f for f in files if f.exists()]
            if not files:
                continue
            defined = set().union(*map(_defined, files))
            for span in spans:
                m = re.fullmatch(r"([A-Z]\w*[a-z]\w*|[a-z_]\w*\(\))", span)
                if m and span.removesuffix("()") not in defined:
                    names = ", ".join(f.relative_to(REPO).as_posix() for f in files)
                    bad.append(f"{_rel(doc)}:{n}: `{span}` is not defined in {names}")
    assert not bad, "\n".join(bad)


def test_the_layout_names_every_package_module():
    """docs/getting_started.md's "Where the code is" names each subpackage, each top-level
    module and each trainers/ module."""
    text = (REPO / "docs" / "getting_started.md").read_text()
    layout = text[text.index("## Where the code is") :]
    wanted = [p for p in PKG.iterdir() if p.name not in ("__init__.py", "__pycache__")] + [
        p for p in (PKG / "trainers").iterdir() if p.suffix == ".py" and p.stem != "__init__"
    ]
    missing = []
    for p in wanted:
        rel = p.relative_to(REPO).as_posix() + ("/" if p.is_dir() else "")
        if f"`{rel}`" not in layout:
            missing.append(rel)
    assert not missing, f"not in getting_started.md's layout: {missing}"


@pytest.mark.parametrize("page", ["ppo_step.md", "algorithms.md"])
def test_every_advantage_estimator_is_documented(page):
    from fsdp_rlhf.algorithms.names import ADVANTAGE_ESTIMATORS

    text = (REPO / "docs" / page).read_text()
    missing = [
        e for e in ADVANTAGE_ESTIMATORS if not re.search(rf"(?<!\w){re.escape(e)}(?!\w)", text)
    ]
    assert not missing, f"{page} does not name {missing}"


@pytest.mark.parametrize(
    "checker,token,problem",
    [
        (_path_problem, "fsdp_rlhf/trainers/ppo_sampling.py", "no fsdp_rlhf/trainers/"),
        (_path_problem, "models/packing.py", None),
        (_path_problem, "models/pack.py", "no fsdp_rlhf/models/pack.py"),
        (_path_problem, "rollout/logprob_diff", None),
        (_path_problem, "slurm/*.sbatch", None),
        (_path_problem, "slurm/*.sh", "no slurm/*.sh"),
        (_path_problem, "tests/{unit,e2e,nowhere}/", "no tests/nowhere"),
        (_path_problem, "demo_out/sft", None),
    ],
)
def test_the_path_check_can_fail(checker, token, problem):
    got = checker(token)
    assert _path_problem("rm_data.py", bare=True) == "no file of that name"
    assert _path_problem("rm_steps.py", bare=True) is None
    assert (got is None) == (problem is None) and (problem is None or problem in got), got


def test_the_name_checks_can_fail():
    assert _resolves("rollout.memory_budget") and not _resolves("rollout.memory_budget.nope")
    assert "ckpt.save_hf_ckpt" in _config_paths() and "ckpt.nope" not in _config_paths()
    assert "OfflineTrainer" in _defined(PKG / "trainers" / "offline")
    assert "start_run" not in _defined(PKG / "trainers" / "common.py")
    assert "rdzv_backend" in _known_flags() and "malloc" not in _known_flags()
