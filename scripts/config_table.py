"""Regenerate the README's config table from the comments in grpolab/config.py.

    python scripts/config_table.py   # rewrites the block between the config-table markers
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- config-table -->", "<!-- /config-table -->"
NESTED = {"codeexec": "reward.code_exec", "judge": "reward.judges.<name>"}   # sections nested in another


def table() -> str:
    rows, section = ["| key | default | meaning |", "| --- | --- | --- |"], None
    for line in (ROOT / "grpolab" / "config.py").read_text().splitlines():
        if m := re.match(r"class (\w+)Config\b", line):
            section = NESTED.get(m.group(1).lower(), m.group(1).lower())
            continue
        if line.startswith("class Config") or line.startswith("def "):
            section = None
        if section and (m := re.match(r"\s+(\w+): ([^=]+)= (.+?)(?:\s+#\s*(.*))?$", line)):
            if m.group(3).startswith("field(default_factory=") and m.group(3)[22:].split(")")[0][0].isupper():
                continue   # a nested section: its keys are listed under their own name
            default = re.sub(r"field\(default_factory=lambda: (.*)\)", r"\1", m.group(3).strip())
            default = {"field(default_factory=list)": "[]", "field(default_factory=dict)": "{}"}.get(default, default)
            rows.append(f"| `{section}.{m.group(1)}` | `{default}` | {(m.group(4) or '').replace('|', '/')} |")
        elif section and (m := re.match(r"\s+#\s+(.*)$", line)) and len(rows) > 2:
            rows[-1] = rows[-1][:-2] + " " + m.group(1).replace("|", "/") + " |"
    return "\n".join(rows)


if __name__ == "__main__":
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, rest = text.split(START)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{START}\n{table()}\n{END}{tail}")
