"""A small Dockerfile reader: stages, their instructions, and which stages feed which.

Why: no Docker engine runs here, so the properties that matter (the operator image never
installs torch, final images run as non-root, every copied path survives .dockerignore) are
checked by reading the file. Pure functions over text.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field


@dataclass
class Stage:
    """One FROM ... AS name block: its base (image or stage) and its instructions."""

    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        """Arguments of every instruction with this keyword (upper case), in order."""
        return [rest for key, rest in self.instructions if key == keyword]


def logical_lines(text: str) -> list[str]:
    """Join backslash continuations and drop comments and blank lines."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    return lines


def parse_stages(text: str) -> dict[str, Stage]:
    """Stages by name (unnamed stages get their index), in file order. A FROM's image names the
    default of a global ARG (declared before the first FROM) as the build does without --build-arg."""
    stages: dict[str, Stage] = {}
    global_args: dict[str, str] = {}
    current: Stage | None = None
    for line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.match(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            if match is None:
                raise ValueError(f"cannot parse FROM {rest!r}")
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), match.group(1))
            current = Stage(name=match.group(2) or str(len(stages)), base=base)
            stages[current.name] = current
        elif current is not None:
            current.instructions.append((keyword, rest.strip()))
        elif keyword == "ARG":
            name, _, default = rest.strip().partition("=")
            global_args[name] = default
    return stages


def copy_from(stage: Stage) -> list[str]:
    """Stages this one copies files from (COPY --from=...)."""
    return re.findall(r"--from=(\S+)", " ".join(stage.args("COPY")))


def ancestry(stages: dict[str, Stage], name: str) -> list[str]:
    """Every stage whose content can reach `name`: its base chain and COPY --from sources."""
    seen: list[str] = []
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in stages:
            continue
        seen.append(current)
        todo += [stages[current].base, *copy_from(stages[current])]
    return seen


def context_sources(stages: dict[str, Stage]) -> list[str]:
    """Paths COPY/ADD take from the build context (not from other stages)."""
    sources: list[str] = []
    for stage in stages.values():
        for keyword, rest in stage.instructions:
            if keyword not in ("COPY", "ADD") or "--from=" in rest:
                continue
            parts = [part for part in rest.split() if not part.startswith("--")]
            sources += [part.rstrip("/") for part in parts[:-1]]
    return sources


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore excludes `path` (the last matching pattern wins; `!` re-includes)."""
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, body) or path.startswith(body + "/"):
            excluded = not negated
    return excluded


def ignore_patterns(text: str) -> list[str]:
    """The patterns of a .dockerignore file."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
