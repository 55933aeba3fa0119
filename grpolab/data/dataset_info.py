"""LLaMA-Factory's dataset_info.json: a folder's description of its data files, applied to a file's rows.

An entry names its file (`file_name`, relative to the folder), and optionally `columns` (LLaMA-Factory's
name -> the file's column) and, for sharegpt, `tags` (the keys and role values its messages use). The rows
are rewritten to LLaMA-Factory's default names (instruction, input, output, history, system, tools,
conversations, chosen, rejected; messages as {from, value} with human / gpt / observation / function_call /
system), which data/formats.py recognises. An entry whose only column is `prompt` is LLaMA-Factory's
pre-training form: that column becomes TRL's `text`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DataError

INFO_FILE = "dataset_info.json"
DEFAULT_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": "history",
                   "messages": "conversations", "system": "system", "tools": "tools", "chosen": "chosen",
                   "rejected": "rejected"}
DEFAULT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
ROLE_TAGS = ("user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")


def entry_for(path: Path) -> tuple[str, dict] | None:
    """(name, entry) of the dataset_info.json beside `path` that describes it, or None (no such file or entry)."""
    info_path = path.parent / INFO_FILE
    if not info_path.is_file():
        return None
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{info_path}: not valid JSON ({e}); fix it or move it away from {path.name}") from None
    if not isinstance(info, dict):
        raise DataError(f"{info_path}: expected an object of dataset entries, got {type(info).__name__}")
    found = [(name, e) for name, e in info.items() if isinstance(e, dict) and isinstance(e.get("file_name"), str)
             and (info_path.parent / e["file_name"]).resolve() == path.resolve()]
    if len({json.dumps([e.get("columns"), e.get("tags")], sort_keys=True) for _, e in found}) > 1:
        raise DataError(f"{info_path}: entries {[n for n, _ in found]} all describe {path.name} with different "
                        f"columns or tags; keep one")
    return found[0] if found else None


def apply_entry(rows: list[dict], name: str, entry: dict, where: str) -> list[dict]:
    """`rows` with the entry's columns renamed to LLaMA-Factory's defaults and its message tags to sharegpt's."""
    columns = entry.get("columns") or {}
    tags = {**DEFAULT_TAGS, **(entry.get("tags") or {})}
    if not isinstance(columns, dict) or not all(isinstance(v, str) for v in columns.values()):
        raise DataError(f"{where}: dataset_info.json entry {name!r}: 'columns' must map names to column names")
    unknown = sorted(set(columns) - set(DEFAULT_COLUMNS) - {"images", "videos", "audios", "kto_tag"})
    if unknown:
        raise DataError(f"{where}: dataset_info.json entry {name!r}: unknown columns {unknown}; "
                        f"LLaMA-Factory's are {sorted(DEFAULT_COLUMNS)}")
    rename = {src: DEFAULT_COLUMNS[ours] for ours, src in columns.items() if ours in DEFAULT_COLUMNS}
    if set(columns) == {"prompt"}:
        rename = {columns["prompt"]: "text"}   # the pre-training form: one text column
    present = {k for row in rows if isinstance(row, dict) for k in row}
    matched_none = {ours: src for ours, src in columns.items() if ours in DEFAULT_COLUMNS and src not in present}
    if rows and matched_none:
        said = ", ".join(f"{ours} -> {src!r}" for ours, src in matched_none.items())
        raise DataError(f"{where}: dataset_info.json entry {name!r}: its columns {said} name columns no row has; "
                        f"the rows have {sorted(present)}")
    roles = {tags[t]: DEFAULT_TAGS[t] for t in ROLE_TAGS if tags.get(t)}
    out = []
    for row in rows:
        new = {k: v for k, v in row.items() if k not in rename}
        new.update({ours: row[src] for src, ours in rename.items() if src in row})
        for k in ("conversations", "chosen", "rejected"):
            v = new.get(k)
            if isinstance(v, list) and k == "conversations":
                new[k] = [_retag(m, tags, roles) for m in v]
            elif isinstance(v, dict):
                new[k] = _retag(v, tags, roles)
        out.append(new)
    return out


def _retag(m: object, tags: dict, roles: dict) -> object:
    if not isinstance(m, dict) or tags["role_tag"] not in m:
        return m
    role = m[tags["role_tag"]]
    return {"from": roles.get(role, role), "value": m.get(tags["content_tag"])}
