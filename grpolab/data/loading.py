"""Prompt datasets from disk or the hub, normalized to rows with 'prompt' and 'answer'.

    read_records        jsonl / json / parquet / csv / save_to_disk dirs / split-file dirs / hub names -> list[dict];
                        a LLaMA-Factory dataset_info.json beside a file renames its columns (data/dataset_info.py)
    normalize_rows      column mapping (dotted keys reach into nested columns), verl rows, LLaMA-Factory's
                        alpaca and sharegpt rows (data/formats.py), system prompt and instruction suffix
    filter_long_prompts drop (or refuse) prompts longer than the prompt budget

A normalized row is the original row with 'prompt' (a str, or a list of {'role', 'content'}
messages) and 'answer' (a str, or None for tasks without one) set. Every other column stays, since
reward functions receive dataset columns by name.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Callable, Iterable

from ..errors import DataError
from .dataset_info import apply_entry, entry_for
from .formats import (
    MISSING,
    PROMPT_FORMATS,
    alpaca_prompt_row,
    dig,
    formats_hint,
    is_alpaca,
    is_sharegpt,
    sharegpt_prompt_row,
)
from .messages import canonical_role, role_problem

SPLIT_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")



# ---------------------------------------------------------------- reading


def read_records(source: str, split: str | None = None, dataset_config: str | None = None) -> list[dict]:
    """Rows of `source` as plain dicts.

    `source` is tried, in order, as: a .jsonl / .json / .parquet / .csv file (a dataset_info.json beside
    it that names it renames its columns, as LLaMA-Factory reads it); a directory written by
    `datasets` `save_to_disk`; a directory holding `<split>.jsonl|.json|.parquet` (or sharded
    `<split>-*.parquet`) files; otherwise a Hugging Face Hub dataset name, loaded with
    `datasets.load_dataset(source, dataset_config, split=split)`.
    `split` picks one split where there are several; a single file or a single saved Dataset has
    only one, so `split` is ignored there.
    """
    path = Path(source).expanduser()
    if path.is_file():
        return _read_file(path, split)
    if path.is_dir():
        return _read_dir(path, split)
    if path.suffix in SPLIT_FILE_SUFFIXES or source.startswith((".", "/", "~")):
        # clearly meant as a local path: asking the hub would only add a confusing network error
        raise DataError(f"{source}: file not found; check the path (relative paths start at {Path.cwd()})")
    return _read_hub(source, split, dataset_config)


def _read_file(path: Path, split: str | None) -> list[dict]:
    if path.suffix == ".jsonl":
        rows = _read_jsonl(path)
    elif path.suffix == ".json":
        rows = _read_json(path, split)
    elif path.suffix == ".parquet":
        rows = _read_parquet([path])
    elif path.suffix == ".csv":
        rows = _read_csv(path)
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json, .parquet or .csv")
    found = entry_for(path)
    return apply_entry(rows, *found, str(path)) if found else rows


def _read_csv(path: Path) -> list[dict]:
    """Rows of a CSV file with a header line, every cell kept as text (an answer '007' stays '007')."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    try:
        names = pacsv.open_csv(path).schema.names
        table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
            column_types={n: pa.string() for n in names}))
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a readable CSV file ({_one_line(e)}); the first line names the "
                        "columns and every row needs one cell per column") from None
    return table.to_pylist()


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, "rb") as f:   # bytes, decoded line by line: a bad byte is reported with its line
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, path, lineno)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                                "each line must be one complete JSON object") from None
            except RecursionError:
                raise DataError(f"{path}: line {lineno}: {_TOO_DEEP}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {lineno}: expected a JSON object, got {type(row).__name__}; "
                                "each line must be one object like {\"prompt\": ..., \"answer\": ...}")
            rows.append(row)
    return rows


# Python's json parser recurses once per level of [ or {, and stops near the interpreter's recursion limit
_TOO_DEEP = ("JSON nested too deeply to read (lists or objects inside each other more than about "
             f"{sys.getrecursionlimit() - 50} levels); flatten the row")


def _decode(raw: bytes, path: Path, first_line: int = 1) -> str:
    """`raw` (the file's bytes from line `first_line` on) as text: UTF-8, a leading byte-order mark (which
    some editors write) dropped; DataError naming the line and byte that are not UTF-8."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{path}: line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {col} of the line); "
                        f"save the file as UTF-8") from None


def _deep_line(text: str, depth: int) -> int:
    """The line where brackets outside strings first nest more than `depth` levels (1 if never)."""
    level, line, in_string, escaped = 0, 1, False, False
    for ch in text:
        if ch == "\n":
            line += 1
        elif in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            level += 1
            if level > depth:
                return line
        elif ch in "]}":
            level -= 1
    return 1


def _read_json(path: Path, split: str | None) -> list[dict]:
    text = _decode(path.read_bytes(), path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: line {e.lineno}: invalid JSON ({e.msg}); for one object per line "
                        "name the file .jsonl") from None
    except RecursionError:
        line = _deep_line(text, sys.getrecursionlimit() - 100)
        raise DataError(f"{path}: line {line}: {_TOO_DEEP}") from None
    if isinstance(data, dict):
        # {"data": [...]} is common; {"train": [...], "test": [...]} with a split also works
        key = split if split is not None and isinstance(data.get(split), list) else "data"
        if not isinstance(data.get(key), list):
            raise DataError(f"{path}: a JSON object must hold the rows as a list under 'data' "
                            f"(keys are {sorted(data)}); or write a list of objects")
        data = data[key]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of objects, got {type(data).__name__}")
    for i, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i}: expected a JSON object, got {type(row).__name__}")
    return data


def _read_parquet(files: list[Path]) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for file in files:
        try:
            rows.extend(pq.read_table(file).to_pylist())
        except Exception as e:  # pyarrow raises several types for corrupt or non-parquet files
            raise DataError(f"{file}: not a readable parquet file ({_one_line(e)})") from None
    return rows


def _read_dir(path: Path, split: str | None) -> list[dict]:
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        import datasets

        return _pick_split(datasets.load_from_disk(str(path)), split, str(path))
    files = _split_files(path)
    if not files:
        raise DataError(f"{path}: directory holds no dataset; expected a datasets save_to_disk folder or "
                        "files named <split>.jsonl, <split>.json, <split>.parquet or <split>.csv")
    if split is None:
        if len(files) > 1:
            raise DataError(f"{path}: holds splits {sorted(files)}; choose one with split")
        split = next(iter(files))
    if split not in files:
        raise DataError(f"{path}: no split {split!r}; splits here are {sorted(files)}")
    chosen = files[split]
    if chosen[0].suffix == ".parquet":
        return _read_parquet(chosen)
    return _read_file(chosen[0], split)


def _split_files(path: Path) -> dict[str, list[Path]]:
    """{split: files} for `<split>.<ext>` files and hub-style `<split>-00000-of-00002.parquet` shards."""
    found: dict[str, list[Path]] = {}
    for file in sorted(path.iterdir()):
        if not file.is_file() or file.suffix not in SPLIT_FILE_SUFFIXES:
            continue
        name = file.stem
        if file.suffix == ".parquet" and "-" in name and name.rsplit("-", 1)[-1].isdigit():
            name = name.split("-", 1)[0]  # shard: train-00000-of-00002 -> train
        if name in found and found[name][0].suffix != file.suffix:
            raise DataError(f"{path}: split {name!r} has both {found[name][0].name} and {file.name}; "
                            "keep one of them")
        found.setdefault(name, []).append(file)
    return found


def _read_hub(source: str, split: str | None, dataset_config: str | None) -> list[dict]:
    try:
        import datasets

        loaded = datasets.load_dataset(source, dataset_config, split=split)
    except Exception as e:  # offline, no such dataset, bad config name: all end here
        raise DataError(f"{source}: not found locally, and loading it from the Hugging Face Hub failed "
                        f"({_one_line(e)}); check the path, or the dataset name and your network") from None
    return _pick_split(loaded, split, source)


def _pick_split(loaded, split: str | None, source: str) -> list[dict]:
    """Rows of a Dataset, or of one split of a DatasetDict."""
    if hasattr(loaded, "keys"):  # DatasetDict
        names = sorted(loaded.keys())
        if split is None:
            if len(names) != 1:
                raise DataError(f"{source}: holds splits {names}; choose one with split")
            split = names[0]
        if split not in loaded:
            raise DataError(f"{source}: no split {split!r}; splits here are {names}")
        loaded = loaded[split]
    return loaded.to_list()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ---------------------------------------------------------------- normalizing


def normalize_rows(records: Iterable[dict], *, prompt_key: str = "prompt", answer_key: str | None = "answer",
                   system_prompt: str | None = None, prompt_suffix: str | None = None,
                   source: str = "") -> list[dict]:
    """Rows with 'prompt' (str or message list) and 'answer' (str or None), other columns kept.

    - The prompt comes from `prompt_key` (a dotted key like `extra_info.question` reads a nested
      column); it must be a non-empty str or a non-empty list of {'role': str, 'content': str} messages
      (verl's format). Rows without it in LLaMA-Factory's alpaca or sharegpt format give their prompt as
      messages, and their output (last gpt turn) is the answer when `answer_key` is not a column.
    - The answer comes from `answer_key`, or, when that is not a column, from
      `reward_model['ground_truth']` (verl's format). Numbers become strings. With `answer_key=None`
      rows get no answer (for reward-model or custom-reward tasks that read other columns).
      Either every row has an answer or none has: a partly missing answer column is an error.
    - `prompt_suffix` is appended after a single space (as verl's GSM8K preprocessing does) to a
      str prompt, or to the content of the last user message of a message list.
    - `system_prompt` turns the prompt into messages: a system message, then the prompt's own
      messages (a str prompt becomes one user message). A message list that already has a system
      message is left as it is: the dataset's own system prompt wins and no second one is added.
    - An existing 'prompt' / 'answer' column is replaced when the keys point elsewhere.
    """
    records = list(records)
    where = f"{source}: " if source else ""
    if not records:
        raise DataError(f"{where}dataset is empty; check the file and the split")
    rows, missing = [], []
    for i, record in enumerate(records, start=1):
        prompt, reference = _prompt_of(record, prompt_key, f"{where}row {i}")
        if prompt_suffix:
            prompt = _add_suffix(prompt, prompt_suffix, f"{where}row {i}")
        if system_prompt:
            prompt = _add_system(prompt, system_prompt)
        answer = _answer_of(record, answer_key, f"{where}row {i}")
        if answer is None and answer_key is not None and dig(record, answer_key) is MISSING:
            answer = reference   # alpaca's output, sharegpt's last gpt turn
        if answer is None:
            missing.append(i)
        rows.append({**record, "prompt": prompt, "answer": answer})
    if missing and len(missing) < len(rows):
        raise DataError(f"{where}row {missing[0]}: no answer (column {answer_key!r} or "
                        f"reward_model.ground_truth), but {len(rows) - len(missing)} of {len(rows)} rows have one; "
                        "fill in the missing answers or drop those rows")
    return rows


def _prompt_of(record: object, prompt_key: str, where: str) -> tuple[str | list[dict], str | None]:
    """(the row's prompt, the reference answer its format carries or None): data.prompt_key (dotted keys
    reach into nested columns), else LLaMA-Factory's sharegpt or alpaca columns."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with columns, got {_preview(record)}")
    value = dig(record, prompt_key)
    if value is not MISSING:
        return _check_prompt(value, where), None
    if is_sharegpt(record):
        return sharegpt_prompt_row(record, where)
    if is_alpaca(record):
        return alpaca_prompt_row(record, where)
    raise DataError(f"{where}: no prompt column {prompt_key!r}; columns are {sorted(record)}; set data.prompt_key "
                    f"to the column that holds the prompt ({formats_hint(PROMPT_FORMATS, 'prompt')})")


def _check_prompt(prompt: object, where: str) -> str | list[dict]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: prompt is empty; remove the row or fill in its prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        check_roles(prompt, where, "prompt")
        # copies, so suffixes never edit the caller's rows
        return [{**m, "role": canonical_role(m["role"])} for m in prompt]
    raise DataError(f"{where}: prompt must be a string or a non-empty list of "
                    f"{{'role': str, 'content': str}} messages, got {_preview(prompt)}")


def check_roles(messages: list[dict], where: str, what: str) -> None:
    """DataError naming the first message whose role the server would refuse too (data/messages.py)."""
    for j, m in enumerate(messages):
        problem = role_problem(m["role"])
        if problem:
            raise DataError(f"{where}: {what} message {j}: {problem}")


def _add_suffix(prompt: str | list[dict], suffix: str, where: str) -> str | list[dict]:
    if isinstance(prompt, str):
        return f"{prompt} {suffix}"
    for m in reversed(prompt):
        if m["role"] == "user":
            m["content"] = f"{m['content']} {suffix}"
            return prompt
    raise DataError(f"{where}: prompt_suffix needs a user message, but the roles are "
                    f"{[m['role'] for m in prompt]}")


def _add_system(prompt: str | list[dict], system_prompt: str) -> list[dict]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system_prompt}] + messages


def _answer_of(record: dict, answer_key: str | None, where: str) -> str | None:
    if answer_key is None:
        return None
    if dig(record, answer_key) is not MISSING:
        value, name = dig(record, answer_key), repr(answer_key)
    elif isinstance(record.get("reward_model"), dict) and "ground_truth" in record["reward_model"]:
        value, name = record["reward_model"]["ground_truth"], "reward_model.ground_truth"
    else:
        return None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):   # JSON's NaN/Infinity: no answer to check against
        raise DataError(f"{where}: answer {name} is {value} (not a number one can be right about); fix the row or "
                        f"drop it")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{where}: answer {name} must be a string or a number, got {_preview(value)}; "
                    "set data.answer_key to a column with one, or to null and read the column in a custom reward")


def _preview(value: object, width: int = 60) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= width else text[:width - 3] + '...'}"


# ---------------------------------------------------------------- filtering


def filter_long_prompts(rows: list[dict], count_tokens: Callable[[object], int], max_length: int,
                        on_long: str = "drop") -> tuple[list[dict], int]:
    """(rows whose prompt fits in `max_length` tokens, number dropped); `max_length <= 0` keeps all.

    `count_tokens` receives the row's prompt (str or messages) and returns its length in tokens,
    chat template included, so the check matches what the model will actually see.
    `on_long='error'` raises on the first long prompt instead of dropping it.
    """
    if on_long not in ("drop", "error"):
        raise ValueError(f"on_long must be 'drop' or 'error', got {on_long!r}")
    if max_length <= 0:
        return list(rows), 0
    kept = []
    for i, row in enumerate(rows, start=1):
        n = count_tokens(row["prompt"])
        if n <= max_length:
            kept.append(row)
        elif on_long == "error":
            raise DataError(f"row {i}: prompt is {n} tokens, over data.max_prompt_length={max_length} "
                            f"({_preview(row['prompt'], 50)}); raise data.max_prompt_length or drop long prompts "
                            "(data.on_long_prompt=drop)")
    return kept, len(rows) - len(kept)
