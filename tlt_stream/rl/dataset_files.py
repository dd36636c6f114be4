"""Dataset files read as rows, by suffix: JSONL, JSON (an array, or JSON lines), CSV and TSV (a header row,
then text fields) and Parquet. A row is numbered where a person would look for it: JSONL's and CSV's by the
line it starts on, a JSON array's and a Parquet file's by position. What a row means, its prompt and answer,
is `datasets`' business; here only how a file's bytes become rows, and how a file that cannot is refused in
one line naming the file and the line."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["FORMATS", "DatasetError", "jsonl_lines", "read_rows"]


FORMATS = ".jsonl, .json, .csv, .tsv or .parquet"
"""The dataset file suffixes read, as a refusal names them."""


class DatasetError(Exception):
    """A dataset file or row is unusable; the message names the file, row and field."""


def jsonl_lines(path: Path, error: type[Exception], where: Callable[[int], str]) -> list[tuple[int, str]]:
    """(line number, line) of every non-blank line of the JSONL file `path`, read as UTF-8 (a leading BOM
    dropped) and split at line feeds only, a carriage return before one dropped: `str.splitlines` also splits
    at U+2028, U+0085 and other characters a JSON string may hold raw. A file that cannot be read or is not UTF-8 raises
    `error` in one line, `where(line)` naming the line that is not."""
    lines = enumerate(_text(path, error, where).split("\n"), start=1)
    return [(number, line.removesuffix("\r")) for number, line in lines if line.strip()]


def _text(path: Path, error: type[Exception], where: Callable[[int], str]) -> str:
    """The file `path` as text (`jsonl_lines`: UTF-8, a leading BOM dropped, else `error`)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise error(f"{where(line)}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None
    return text


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """A `.json` file's rows: a JSON array of rows (row i is its i-th element), or JSON lines, as Hugging Face
    `datasets` writes a `.json` file by default."""
    lines = jsonl_lines(path, DatasetError, lambda n: f"{path}: row {n}")
    if lines and lines[0][1].lstrip().startswith("["):
        try:
            rows = json.loads("\n".join(line for _, line in lines))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(rows, list):
            raise DatasetError(f"{path}: expected a JSON array of rows or one JSON object a line")
        yield from enumerate(rows, start=1)
        return
    yield from _jsonl_rows(path, lines)


def _jsonl_rows(path: Path, lines: list[tuple[int, str]]) -> Iterator[tuple[int, Any]]:
    for number, line in lines:
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: row {number}: not valid JSON ({exc.msg})") from None


def _csv_rows(path: Path, delimiter: str) -> Iterator[tuple[int, dict[str, str]]]:
    """A CSV (or, `delimiter` a tab, TSV) file's rows as Python's `csv` and Excel write them: the first row
    names the columns (names stripped of spaces; a column with a blank name, as pandas writes its index, is
    left out), a field is quoted when it holds the delimiter, a quote or a line break (kept as written), a
    UTF-8 BOM is dropped and blank rows are skipped. Every value is text, an answer's digits as written. Row n
    is the row that starts on line n (as JSONL's row n is line n); a row with more or fewer fields than the
    header, or an unclosed quote, stops loading in one line naming it."""
    kind = "CSV" if delimiter == "," else "TSV"
    text = _text(path, DatasetError, lambda n: f"{path}: line {n}")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    names: list[str] | None = None
    while True:
        start = reader.line_num + 1
        try:
            record = next(reader, None)
        except csv.Error as exc:
            raise DatasetError(f"{path}: line {start}: not valid {kind} ({exc})") from None
        if record is None:
            return
        if not any(value.strip() for value in record):
            continue
        if names is None:
            names = [name.strip() for name in record]
            repeated = sorted({name for name in names if name and names.count(name) > 1})
            if repeated:
                raise DatasetError(f"{path}: line {start}: the header names column {repeated[0]!r} twice")
            continue
        if len(record) != len(names):
            separator = "a comma" if delimiter == "," else "a tab"
            fields = f"{len(record)} field" + ("s" if len(record) != 1 else "")
            raise DatasetError(
                f"{path}: line {start}: {fields} where the header has {len(names)} "
                f"(a field holding {separator} or a line break must be in double quotes)"
            )
        yield start, {name: value for name, value in zip(names, record, strict=True) if name}


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise DatasetError(f"{path}: not a readable Parquet file ({exc})") from None
    rows = table.to_pylist()
    for name, kind in zip(table.column_names, table.schema.types, strict=True):
        if _holds_narrow_float(kind):
            for row in rows:
                row[name] = _as_written(row[name], kind)
    return rows


def _holds_narrow_float(kind: Any) -> bool:
    import pyarrow.types as pat

    if pat.is_float32(kind) or pat.is_float16(kind):
        return True
    if pat.is_struct(kind):
        return any(_holds_narrow_float(kind.field(i).type) for i in range(kind.num_fields))
    if pat.is_list(kind) or pat.is_large_list(kind) or pat.is_fixed_size_list(kind):
        return _holds_narrow_float(kind.value_type)
    return False


def _as_written(value: Any, kind: Any) -> Any:
    """A value of a float32 or float16 column (or nested in a struct or list one) as the shortest decimal
    that reads back as it, the number its writer wrote: 0.1, not 0.10000000149011612, which is float32's
    nearest to 0.1 widened to a double as pyarrow reads it."""
    import numpy as np
    import pyarrow.types as pat

    if value is None:
        return None
    if pat.is_float32(kind):
        return float(str(np.float32(value)))
    if pat.is_float16(kind):
        return float(str(np.float16(value)))
    if pat.is_struct(kind):
        fields = [kind.field(i) for i in range(kind.num_fields)]
        return value | {f.name: _as_written(value[f.name], f.type) for f in fields}
    if pat.is_list(kind) or pat.is_large_list(kind) or pat.is_fixed_size_list(kind):
        return [_as_written(item, kind.value_type) for item in value]
    return value


def read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number, row) of every row of the dataset file `path`, read by its suffix."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_rows(path, jsonl_lines(path, DatasetError, lambda n: f"{path}: row {n}"))
    elif suffix == ".json":
        yield from _json_rows(path)
    elif suffix in (".csv", ".tsv"):
        yield from _csv_rows(path, "," if suffix == ".csv" else "\t")
    elif suffix == ".parquet":
        yield from enumerate(_parquet_rows(path), start=1)
    else:
        raise DatasetError(f"{path}: unsupported dataset format {path.suffix!r} (use {FORMATS})")
