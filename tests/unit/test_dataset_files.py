"""Dataset files as rows: CSV and TSV as Python's `csv` writes them and as a person or Excel writes them by
hand (BOM, CRLF, line breaks in quotes) read as the same rows as JSONL; a ragged row or an unclosed quote is
refused in one line naming the file and the line; a float32 Parquet answer reads as the number written."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_stream.rl.datasets import DatasetError, load_examples

# Values a CSV writer must quote (the delimiters, quotes, line breaks), and answers whose digits a number would lose.
ROWS = [
    {"prompt": 'Say "hi", then\nadd 1\tand 2.', "answer": "3", "id": "a"},
    {"prompt": "Q: 0.1 as a fraction?\r\nA:", "answer": "0.10", "id": "b"},
    {"prompt": "Ünïcode, ok", "answer": "67.0", "id": "c"},
    {"prompt": "1e3 in full?", "answer": "1e3", "id": ""},
]


def loaded(path: Path, **kwargs: object) -> list[tuple[str, str, dict, str]]:
    return [(e.prompt, e.answer, e.fields, e.prompt_id) for e in load_examples(path, **kwargs)]


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize(("suffix", "delimiter"), [(".csv", ","), (".tsv", "\t")])
def test_csv_written_by_pythons_writer_reads_as_its_rows(tmp_path: Path, suffix: str, delimiter: str) -> None:
    path = tmp_path / f"d{suffix}"
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "answer", "id"], delimiter=delimiter)
        writer.writeheader()
        writer.writerows(ROWS)
    rows = loaded(path)
    assert [(p, a, fields) for p, a, fields, _ in rows] == [(r["prompt"], r["answer"], {"id": r["id"]}) for r in ROWS]
    assert rows == loaded(jsonl(tmp_path / "d.jsonl", ROWS))  # the same ids too


HAND_CSV = (
    "\ufeffprompt , answer,id\r\n"  # Excel's BOM and CRLF; spaces around a name
    '"Say ""hi"", then\nadd 1\tand 2.",3,a\r\n'  # a quote doubled, a line feed inside quotes (Excel's Alt+Enter)
    "\r\n"
    "Ünïcode, ok,67.0,c\r\n"  # unquoted: the comma splits, so this row is ragged unless quoted (fixed below)
)


def test_hand_written_csv_and_tsv_read_as_the_same_rows(tmp_path: Path) -> None:
    expected = [
        ('Say "hi", then\nadd 1\tand 2.', "3", {"id": "a"}),
        ("Ünïcode, ok", "67.0", {"id": "c"}),
        ("x", "0.10", {"id": ""}),
    ]
    text = HAND_CSV.replace("Ünïcode, ok,", '"Ünïcode, ok",') + "x,0.10,\r\n\r\n"
    (tmp_path / "d.csv").write_bytes(text.encode("utf-8"))
    tsv = '\ufeffprompt\tanswer\tid\n"Say ""hi"", then\nadd 1\tand 2."\t3\ta\n\nÜnïcode, ok\t67.0\tc\nx\t0.10\t\n'
    (tmp_path / "d.tsv").write_bytes(tsv.encode("utf-8"))
    rows = [{"prompt": p, "answer": a, **fields} for p, a, fields in expected]
    want = loaded(jsonl(tmp_path / "d.jsonl", rows))
    assert [(p, a, fields) for p, a, fields, _ in want] == expected
    assert loaded(tmp_path / "d.csv") == want
    assert loaded(tmp_path / "d.tsv") == want


def test_a_ragged_row_is_named_by_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_bytes(HAND_CSV.encode("utf-8"))  # the last row, on line 5, has 4 fields
    with pytest.raises(DatasetError) as caught:
        load_examples(tmp_path / "d.csv")
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'd.csv'}: line 5: 4 fields where the header has 3")
    assert "\n" not in message
    (tmp_path / "t.tsv").write_text("prompt\tanswer\na\t1\nb\n")
    with pytest.raises(DatasetError, match=r"t\.tsv: line 3: 1 field where the header has 2 .*a tab"):
        load_examples(tmp_path / "t.tsv")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('prompt,answer\n"open,1\nx,2\n', r"d\.csv: line 2: not valid CSV \(unexpected end of data\)"),
        ('prompt,answer\nok,1\n"q"x,2\n', r"d\.csv: line 3: not valid CSV"),
        ('prompt,answer\n"a\nb",1\nc,\n', r"d\.csv: row 4: field 'answer' must be a non-empty string"),
        ("prompt,answer,prompt\na,1,b\n", r"d\.csv: line 1: the header names column 'prompt' twice"),
        ("prompt,answer\n", r"d\.csv: no rows"),
    ],
)
def test_bad_csv_is_refused_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "d.csv").write_text(text)
    with pytest.raises(DatasetError, match=message):
        load_examples(tmp_path / "d.csv")


def test_a_csv_not_in_utf8_names_the_line(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_bytes("prompt,answer\nok,1\ncafé,2\n".encode("cp1252"))  # Excel's "CSV" on Windows
    with pytest.raises(DatasetError, match=r"d\.csv: line 3: not UTF-8 text .* save the file as UTF-8"):
        load_examples(tmp_path / "d.csv")


def test_csv_columns_are_found_as_in_other_formats(tmp_path: Path) -> None:
    # pandas' to_csv writes its index as a first column with a blank name; verl's answer field as a flat column.
    (tmp_path / "d.csv").write_text(",prompt,reward_model.ground_truth,source\n0,What is 3*4?,12,toy\n")
    ((prompt, answer, fields, _),) = loaded(tmp_path / "d.csv")
    assert (prompt, answer, fields) == ("What is 3*4?", "12", {"source": "toy"})
    (tmp_path / "q.csv").write_text("q,gold\n1+1?,2\n")
    assert [r[:2] for r in loaded(tmp_path / "q.csv", prompt_field="q", answer_field="gold")] == [("1+1?", "2")]


def test_float32_parquet_answers_read_as_written(tmp_path: Path) -> None:
    table = pa.table(
        {
            "prompt": ["a", "b", "c"],
            "answer": pa.array([0.1, 2.5, 1e-7], pa.float32()),
            "reward_model": pa.array(
                [{"ground_truth": 0.1}, {"ground_truth": 0.3}, {"ground_truth": 7.0}],
                pa.struct([("ground_truth", pa.float32())]),
            ),
            "weights": pa.array([[0.1, 0.2], [], None], pa.list_(pa.float32())),
            "half": pa.array([0.1, 0.5, None], pa.float16()),
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    examples = load_examples(tmp_path / "d.parquet")
    assert [e.answer for e in examples] == ["0.1", "2.5", "0.0000001"]
    assert examples[0].fields == {"reward_model": {"ground_truth": 0.1}, "weights": [0.1, 0.2], "half": 0.1}
    verl = load_examples(tmp_path / "d.parquet", answer_field="reward_model.ground_truth")
    assert [e.answer for e in verl] == ["0.1", "0.3", "7"]
    wide = pa.table({"prompt": ["a"], "answer": pa.array([0.1], pa.float64())})
    pq.write_table(wide, tmp_path / "w.parquet")
    assert load_examples(tmp_path / "w.parquet")[0].answer == "0.1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "question\tanswer\nwhat is 1 plus 2?\t3\n",
            r"row 2: missing field 'prompt' \(the row's fields: question, answer; set data\.prompt_field to the one",
        ),
        (
            "prompt\tsolution\nwhat is 1 plus 2?\t3\n",
            r"row 2: missing field 'answer' \(the row's fields: prompt, solution; set data\.answer_field to the one",
        ),
    ],
)
def test_a_first_row_without_the_field_names_the_columns_it_has_and_the_setting(
    tmp_path: Path, text: str, message: str
) -> None:
    """It said only "missing field 'prompt'" of a file whose prompt column is named otherwise."""
    path = tmp_path / "d.tsv"
    path.write_text(text)
    with pytest.raises(DatasetError, match=message):
        load_examples(path)
