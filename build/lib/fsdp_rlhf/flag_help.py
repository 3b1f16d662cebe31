"""``--help`` and the flag reference in ``docs/``: one line per flag, grouped by section.

Plain text, never wrapped: a flag's name, type, default and help stay on one line whatever the
terminal width or pipe, so ``fsdp-rlhf ppo --help | grep -- --overlong_buffer_len`` finds it.
The same rows make ``docs/configuration.md`` (``render_markdown``), and a test keeps that page
current.
"""

from __future__ import annotations

from fsdp_rlhf.compat import aliases
from fsdp_rlhf.config_base import flags_help

# Section titles by top-level config field, in the order they are shown.
SECTIONS: dict[str, str] = {
    "model": "Models",
    "models": "Models",
    "placement": "Placement",
    "data": "Data",
    "rollout": "Rollout",
    "multiturn": "Multi-turn",
    "algo": "Algorithm",
    "loss": "Algorithm",
    "batch": "Batch sizes",
    "actor_optim": "Optimizer",
    "critic_optim": "Optimizer",
    "optim": "Optimizer",
    "backend": "Precision, kernels and memory",
    "fsdp": "Precision, kernels and memory",
    "ckpt": "Checkpoints",
    "logging": "Logging",
    "eval": "Evaluation",
    "lora": "LoRA",
    "guard": "Faults",
    "": "Other",
}
ALIASES_TITLE = "OpenRLHF aliases (v0.10 flat and v0.11 dotted spellings, translated at start)"


def grouped(config_cls: type) -> dict[str, list[tuple[str, str, str, str]]]:
    """Section title -> rows of (flag, type, default, help), sections in ``SECTIONS`` order."""
    groups: dict[str, list[tuple[str, str, str, str]]] = {t: [] for t in SECTIONS.values()}
    for section, flag, tp, default, text in flags_help(config_cls):
        title = SECTIONS.get(section, section.replace("_", " ").capitalize())
        groups.setdefault(title, []).append((flag, tp, default, text))
    return {title: rows for title, rows in groups.items() if rows}


def render_help(config_cls: type, command: str, title: str) -> str:
    """The ``--help`` text of ``command``."""
    groups = grouped(config_cls)
    # long choice lists push their own line out rather than every line's help
    width = min(40, max(len(f"{f} {t}") for rows in groups.values() for f, t, _, _ in rows))
    lines = [
        title,
        f"usage: fsdp-rlhf {command} [--config FILE.yaml] [--debug] [--FLAG VALUE ...]",
        "Flags take dashes or underscores; booleans are switches (--bf16, --no_bf16, "
        "--bf16=false);",
        "--config sets any field of the config tree first, flags win. Dotted paths "
        "(--optim.adam_betas) work too.",
    ]
    for section, rows in groups.items():
        lines += ["", f"{section}:"]
        for flag, tp, default, text in rows:
            lines.append(f"  {f'{flag} {tp}':<{width}}  [default: {default}]  {text}")
    foreign = aliases(command)
    if foreign:
        lines += ["", f"{ALIASES_TITLE}:"]
        w = max(len(name) for name, _ in foreign)
        lines += [f"  {name:<{w}}  -> {target}" for name, target in foreign]
    return "\n".join(lines) + "\n"


def render_markdown(config_cls: type, command: str) -> str:
    """The flag reference of ``command`` as Markdown tables, one per section."""
    out = [f"## `fsdp-rlhf {command}`", ""]
    for section, rows in grouped(config_cls).items():
        out += [
            f"### {section}",
            "",
            "| flag | type | default | what it does |",
            "|---|---|---|---|",
        ]
        for flag, tp, default, text in rows:
            cell = text.replace("|", "\\|")
            tp_cell = tp.replace("|", "\\|")
            out.append(f"| `{flag}` | {tp_cell} | `{default}` | {cell} |")
        out.append("")
    return "\n".join(out)
