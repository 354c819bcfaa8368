"""Generate the API reference page (``docs/api.md``) from the specs (:data:`unicoll.spec.SPECS`)
and the registered backends' capability tables.

    python tools/docgen.py docs/api.md     # rewrite the page
    python tools/docgen.py                 # print it

A tool of the repository, not part of the installed package.
"""

from __future__ import annotations

import sys

from unicoll import registry
from unicoll.arrays import DTYPES
from unicoll.backends.base import MOE_ENTRY_POINTS, REDUCE_OPS
from unicoll.eager import ops as eager_ops
from unicoll.spec import MOE_MODES, OPS, REQUIRED, SPECS, OpSpec, Param


def _default(param: Param) -> str:
    return "" if param.default is REQUIRED else f"={param.default!r}"


def signature(op: OpSpec) -> str:
    """``name(p1, p2=default, *, p3, ...)`` as the spec describes it."""
    names, star = [], False
    for p in op.params:
        if p.keyword_only and not star:
            names.append("*")
            star = True
        names.append(p.name + _default(p))
    return f"{op.name}({', '.join(names)})"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def render_op(op: OpSpec) -> list[str]:
    lines = [f"## `{op.name}`", "", "```python", f"unicoll.{signature(op)}", "```", "", op.summary, ""]
    lines += ["| parameter | type | default | meaning |", "|---|---|---|---|"]
    for p in op.params:
        default = "required" if p.default is REQUIRED else f"`{p.default!r}`"
        lines.append(f"| `{p.name}` | {_escape(p.annotation)} | {default} | {_escape(p.doc)} |")
    lines += ["", "Checked on every rank before any communication (W is the group size):", ""]
    for p in op.params:
        lines.append(f"- `{p.name}`: {p.kind.doc}")
    for rule in op.rules:
        expected = rule.expected.replace("{W}", "W")
        lines.append(f"- `{rule.param}`: {rule.error.__name__} unless {expected}.")
    lines += ["", _gradient(op), ""]
    return lines


def _gradient(op: OpSpec) -> str:
    """The line that says the operator's gradient: its backward function's docstring (the first
    paragraph, unicoll.eager.ops.<name>_backward), or the spec's words for one without such a
    function."""
    backward = getattr(eager_ops, f"{op.name}_backward", None)
    if backward is None:
        return f"Gradient: {op.backward}."
    first = " ".join(backward.__doc__.split("\n\n")[0].split())
    return f"Gradient (`unicoll.eager.ops.{backward.__name__}`): {first}"


def render_capabilities() -> list[str]:
    factories = registry.registered()
    lines = ["## Backends and what they move", ""]
    lines += ["| backend | operators | libraries | devices | dtypes | MoE rows moved by |", "|---|---|---|---|---|---|"]
    for name, factory in factories.items():
        caps = factory.capabilities
        ops = ", ".join(op for op in OPS if caps.provides(op))
        dtypes = ", ".join(d for d in DTYPES if d in caps.dtypes)
        moe = ", ".join(f"its own `{entry}`" for entry in MOE_ENTRY_POINTS if entry in caps.moe) or "its primitives"
        lines.append(
            f"| `{name}` | {ops} | {', '.join(sorted(caps.libraries))} | {', '.join(sorted(caps.devices))} | {dtypes} "
            f"| {moe} |"
        )
    lines += ["", "The reductions of `all_reduce` and `reduce_scatter`, and the dtypes each backend runs them on:", ""]
    lines += ["| backend | " + " | ".join(REDUCE_OPS) + " |", "|---|" + "---|" * len(REDUCE_OPS)]
    for name, factory in factories.items():
        table = factory.capabilities.reductions
        cells = [", ".join(d for d in DTYPES if d in table.get(op, ())) or "none" for op in REDUCE_OPS]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _yes(flag: bool, why_not: str = "no") -> str:
    return "yes" if flag else why_not


def render_moe_modes() -> list[str]:
    """Per backend, what each mode of ``unicoll.moe`` offers, from the specs' ``reads_host``,
    ``static_shapes`` and ``backward`` and the backend's libraries and devices."""
    lines = ["## The modes of `unicoll.moe` on each backend", ""]
    lines += [
        "A mode is its dispatch, redispatch and combine. *No host sync*: no call reads an array's values on the "
        "host (with a GPU, no synchronization). *Backward*: torch autograd through every call. *torch.compile*: "
        "traced with `fullgraph=True` and no dynamic shapes or `capture_scalar_outputs` (every output shape follows "
        "from the arguments' shapes). *CUDA graph*: capturable, which needs all three and a CUDA device. On a host "
        "backend (its arrays in host memory) there is no device to wait for: there the static mode's eager calls "
        "read the counts in host memory so that only the valid rows travel, and its compiled calls read nothing "
        "(docs/semantics.md).",
        "",
        "| backend | mode | operators | no host sync | backward | torch.compile, static shapes | CUDA graph |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, factory in registry.registered().items():
        caps = factory.capabilities
        torch = "torch" in caps.libraries
        for mode, specs in MOE_MODES.items():
            no_sync = not any(op.reads_host for op in specs)
            static = all(op.static_shapes for op in specs)
            backward = torch and all(op.backward for op in specs)
            compiled = torch and static
            graph = _yes(compiled and no_sync and backward and "cuda" in caps.devices, "no" if "cuda" in caps.devices
                         else "n/a (no CUDA device)")  # fmt: skip
            names = ", ".join(f"`{op.name}`" for op in specs)
            lines.append(
                f"| `{name}` | {mode} | {names} | {_yes(no_sync)} | {_yes(backward)} | {_yes(compiled)} | {graph} |"
            )
    return [*lines, ""]


def render() -> str:
    """The whole API page."""
    lines = [
        "# API reference: operators",
        "",
        "<!-- Generated by `python tools/docgen.py docs/api.md` from unicoll/spec/; do not edit by hand. -->",
        "",
        "Errors read `<operator>: <parameter>: expected <what>, got <what was given>`.",
        "",
    ]
    for op in SPECS.values():
        lines += render_op(op)
    lines += render_capabilities()
    lines += render_moe_modes()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args:
        with open(args[0], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
