"""Prompt files as Windows tools save them: a UTF-8 byte-order mark, UTF-16 and UTF-32 with their marks, and files
that are no text at all (`pan2cli.pipeline.prompts.read_prompt_text`)."""

from __future__ import annotations

import codecs

import pytest

from pan2cli.errors import InputError
from pan2cli.pipeline.prompts import read_prompt_file


def _prompts(path) -> list[str]:
    records, _ = read_prompt_file(path)
    return [r.prompt for r in records]


@pytest.mark.parametrize("name", ["p.json", "p.jsonl", "p.txt"])
@pytest.mark.parametrize(
    "encoding, bom",
    [
        ("utf-8", codecs.BOM_UTF8),
        ("utf-16-le", codecs.BOM_UTF16_LE),
        ("utf-16-be", codecs.BOM_UTF16_BE),
        ("utf-32-le", codecs.BOM_UTF32_LE),
        ("utf-32-be", codecs.BOM_UTF32_BE),
    ],
)
def test_a_byte_order_mark_is_read_and_dropped(tmp_path, name, encoding, bom):
    """A mark before JSON was refused as "not valid JSON"; before plain text it became the first prompt's first
    character (another prompt, another file name). Each encoding with its mark reads as the same prompts."""
    text = {
        "p.json": '["bom prompt", {"prompt": "café"}]\n',
        "p.jsonl": '"bom prompt"\n{"prompt": "café"}\n',
        "p.txt": "bom prompt\ncafé\n",
    }[name]
    path = tmp_path / name
    path.write_bytes(bom + text.encode(encoding))
    assert _prompts(path) == ["bom prompt", "café"]
    records, _ = read_prompt_file(path)
    assert records[0].stem == "000_bom-prompt"


@pytest.mark.parametrize(
    "content, message",
    [
        (
            codecs.BOM_UTF16_LE + '["x"]'.encode("utf-16-le")[:-1],
            "is not UTF-16-LE text",
        ),  # cut mid-character
        (b"a cat\n\xff\xfeb\n", "is not UTF-8 text: byte 0xff at offset 6 cannot be decoded"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is not a text file: it holds a NUL byte at offset 8"),
        (
            '["x"]'.encode("utf-16-le"),
            "is not a text file: it holds a NUL byte at offset 1",
        ),  # UTF-16 without a mark
    ],
    ids=["utf-16 cut", "latin-1", "binary", "utf-16 without a mark"],
)
def test_a_file_that_is_no_text_is_one_error_naming_the_file_and_the_offset(tmp_path, content, message):
    """UTF-16 or a binary file gave a bare `'utf-8' codec can't decode byte 0xff` with no hint."""
    path = tmp_path / "prompts.json"
    path.write_bytes(content)
    with pytest.raises(InputError) as caught:
        read_prompt_file(path)
    assert str(caught.value).startswith(f"--prompts {path} ") and message in str(caught.value)
    assert "UTF-8" in caught.value.hint


def test_the_cli_reads_a_utf16_prompt_file_and_refuses_a_binary_one(run_cli, tmp_path):
    """Both before anything loads: the model folder here does not even exist."""
    (tmp_path / "out").mkdir()
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"\x00\x01\x02")
    res = run_cli(
        "generate",
        "--prompts",
        binary,
        "--model",
        tmp_path / "nope",
        "--device",
        "cpu",
        "-o",
        tmp_path / "out",
    )
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        f"Error: --prompts {binary} is not a text file: it holds a NUL byte at offset 0",
        "Hint: save it as UTF-8 text (one prompt per line, JSON or JSON Lines)",
    ]
