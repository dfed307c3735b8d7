"""Issue 29, item 5: ``prefixcache convert`` turns a user's own requests into a Mooncake trace.

Equal prefixes get equal leading hash IDs, a different block after an equal
prefix a new one, the partial last block an ID of its own; every bad line is
refused naming its number, and a refused input leaves no trace file behind.
Chat logs are tokenized by a ``module:function`` tokenizer written into a
temporary folder (there is no network to fetch a Hugging Face model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import load_mooncake_trace
from prefixcache.tools import cli
from prefixcache.tools.convert import TraceBuilder, convert, read_token_requests
from prefixcache.tools.tokenizer import load_tokenizer, messages_text

# A tokenizer a user could write: one token per character of "role: content" lines.
TOKENIZER_MODULE = """
def tokenize(messages):
    text = "".join(f"{m['role']}: {m['content']}\\n" for m in messages)
    return [ord(character) for character in text]
"""
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers briefly."}


def write_lines(path: Path, records: list[Any]) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
        encoding="utf-8",
    )
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = cli.main(argv)
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def tokenizer_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    folder = tmp_path / "tokenizer_module"
    folder.mkdir()
    (folder / "chars_tokenizer.py").write_text(TOKENIZER_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(folder))
    return "chars_tokenizer:tokenize"


def test_equal_prefixes_share_ids_and_a_partial_last_block_gets_its_own() -> None:
    builder = TraceBuilder(block_size=4)
    first = builder.hash_ids(list(range(10)))  # blocks 0-3, 4-7, and 8-9 (partial)
    second = builder.hash_ids([*range(8), 50, 51, 52, 53])  # same two blocks, then another
    assert first == [0, 1, 2]
    assert second == [0, 1, 3]
    assert builder.hash_ids(list(range(8))) == [0, 1]  # the prefix alone: no partial block
    assert builder.hash_ids([*range(8), 8]) == [0, 1, 4]  # a shorter partial tail differs
    # the same block after a different prefix is a different block (chained, as Mooncake's)
    assert builder.hash_ids([9, 9, 9, 9, 4, 5, 6, 7])[1] != first[1]


def test_a_converted_chat_log_gives_shared_prefixes_equal_leading_ids(
    tmp_path: Path, tokenizer_spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    chats = write_lines(
        tmp_path / "chats.jsonl",
        [
            {"messages": [SYSTEM, {"role": "user", "content": "What is a KV cache?"}]},
            {"messages": [SYSTEM, {"role": "user", "content": "Name three eviction policies."}]},
            {"messages": [{"role": "user", "content": "Unrelated question, no system prompt"}]},
        ],
    )
    out = tmp_path / "trace.jsonl"
    argv = ["convert", str(chats), "--from", "chat", "--tokenizer", tokenizer_spec]
    status, printed, err = run([*argv, "--block-size", "16", "-o", str(out)], capsys)
    assert status == 0, err
    assert f"wrote 3 requests in 16-token blocks to {out}" in printed
    first, second, third = load_mooncake_trace(out)
    shared = len(messages_text([SYSTEM])) // 16  # full blocks of the common system prompt
    assert shared >= 2
    assert first.hash_ids[:shared] == second.hash_ids[:shared]
    assert first.hash_ids[-1] != second.hash_ids[-1]
    assert third.hash_ids[0] not in first.hash_ids
    text = messages_text(json.loads(chats.read_text().splitlines()[0])["messages"])
    assert first.input_length == len(text)
    assert first.num_blocks == -(-len(text) // 16)


def test_token_lines_keep_sessions_and_relative_timestamps(tmp_path: Path) -> None:
    lines = [
        json.dumps({"token_ids": [1, 2, 3], "session_id": "s1", "timestamp": 5000}),
        "",
        json.dumps({"prompt_token_ids": [1, 2, 3, 4], "conversation_id": 7, "output_length": 9}),
        json.dumps({"input_ids": [8], "timestamp": 5250.4}),
    ]
    out = tmp_path / "trace.jsonl"
    with out.open("w", encoding="utf-8") as file:
        assert convert(read_token_requests(lines), file, block_size=2) == 3
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["timestamp"] for r in records] == [0, 0, 250]
    assert [r["hash_ids"] for r in records] == [[0, 1], [0, 2], [3]]
    assert [r.get("session_id") for r in records] == ["s1", 7, None]
    assert [r["output_length"] for r in records] == [0, 9, 0]
    assert len(load_mooncake_trace(out)) == 3  # the loader reads it, extra field and all


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"tokens": [1]}', "no token IDs"),
        ('{"token_ids": [1, -2]}', "token_ids must be a list of ints"),
        ('{"token_ids": [1, 2.5]}', "token_ids must be a list of ints"),
        ('{"token_ids": []}', "the prompt has no tokens"),
        ('{"token_ids": [1], "timestamp": "noon"}', "timestamp must be a number"),
        ('{"token_ids": [1], "output_length": -1}', "output_length must be an int"),
        ('{"token_ids": [1], "session_id": [1]}', "a session id must be"),
        ('{"token_ids": [1], "timestamp": 10}', "earlier than the line before"),
    ],
)
def test_a_bad_line_is_refused_with_its_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, reason: str
) -> None:
    good = json.dumps({"token_ids": [1, 2], "timestamp": 50})
    source = write_lines(tmp_path / "in.jsonl", [good, good, line])
    out = tmp_path / "trace.jsonl"
    status, printed, err = run(["convert", str(source), "-o", str(out)], capsys)
    assert status == 1
    assert printed == ""
    assert err.strip() == err.strip().splitlines()[0]  # one line
    assert f"{source}, line 3: " in err and reason in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no trace, no temp


def test_an_empty_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_lines(tmp_path / "in.jsonl", ["", "  "])
    status, _, err = run(["convert", str(source)], capsys)
    assert status == 1 and "no requests in the input" in err


def test_chat_lines_that_are_not_chats_are_refused(tokenizer_spec: str) -> None:
    from prefixcache.tools.convert import read_chat_requests

    tokenize = load_tokenizer(tokenizer_spec)
    for line, reason in [
        ('{"prompt": "hi"}', "non-empty list 'messages'"),
        ('{"messages": [{"content": "hi"}]}', "string 'role'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "'content' must be"),
    ]:
        good = '{"messages": [{"role": "user", "content": "ok"}]}'
        with pytest.raises(InvalidArgumentError, match=f"line 2: .*{reason}"):
            list(read_chat_requests([good, line], tokenize))

    def broken(messages: list[dict[str, Any]]) -> list[int]:
        raise KeyError("no such token")

    with pytest.raises(InvalidArgumentError, match="line 1: the tokenizer failed"):
        list(read_chat_requests(['{"messages": [{"role": "user", "content": "x"}]}'], broken))


def test_convert_arguments_are_checked_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_lines(tmp_path / "in.jsonl", [{"messages": [SYSTEM]}])
    cases = [
        (["convert", str(tmp_path / "missing.jsonl")], "is not a file"),
        (["convert", str(source), "--from", "chat"], "needs a tokenizer"),
        (["convert", str(source), "--tokenizer", "x:y"], "holds token IDs already"),
        (["convert", str(source), "-o", str(tmp_path / "no" / "t.jsonl")], "does not exist"),
        (["convert", str(source), "-o", str(source)], "would overwrite the input"),
        (
            ["convert", str(source), "--from", "chat", "--tokenizer", "no_such_module_x:f"],
            "cannot import tokenizer module",
        ),
    ]
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    cases.append(
        (
            ["convert", str(source), "--from", "chat", "--tokenizer", "org/model"],
            "pip install transformers",
        )
    )
    for argv, reason in cases:
        status, _, err = run(argv, capsys)
        assert status == 2, (argv, err)
        assert "prefixcache: error: argument" in err and reason in err, err


class FakeHuggingFace:
    """What ``_HuggingFaceChat`` uses of a Hugging Face tokenizer, recording its calls."""

    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template
        self.calls: list[tuple[str, Any]] = []

    def apply_chat_template(self, messages: Any, **options: Any) -> list[int]:
        self.calls.append(("template", options))
        return [1, 2, 3]

    def encode(self, text: str) -> list[int]:
        self.calls.append(("encode", text))
        return [4, 5]


def test_a_hugging_face_tokenizer_uses_its_chat_template_with_the_generation_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    loaded: list[str] = []
    fakes = [FakeHuggingFace("{{ messages }}"), FakeHuggingFace(None)]

    def from_pretrained(name: str) -> FakeHuggingFace:
        loaded.append(name)
        return fakes[len(loaded) - 1]

    fake_module = SimpleNamespace(AutoTokenizer=SimpleNamespace(from_pretrained=from_pretrained))
    monkeypatch.setitem(sys.modules, "transformers", fake_module)
    messages = [{"role": "user", "content": "hi"}]
    assert load_tokenizer("org/chat-model")(messages) == [1, 2, 3]
    assert fakes[0].calls == [
        ("template", {"tokenize": True, "add_generation_prompt": True, "return_dict": False})
    ]
    assert load_tokenizer("org/base-model")(messages) == [4, 5]  # no template: role lines
    assert fakes[1].calls == [("encode", "user: hi\n")]
    assert loaded == ["org/chat-model", "org/base-model"]


def test_without_output_the_trace_goes_to_stdout_and_the_summary_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_lines(tmp_path / "in.jsonl", [{"token_ids": [1, 2, 3]}])
    status, printed, err = run(["convert", str(source), "--block-size", "2"], capsys)
    assert status == 0
    assert json.loads(printed) == {
        "timestamp": 0,
        "input_length": 3,
        "output_length": 0,
        "hash_ids": [0, 1],
    }
    assert "wrote 1 requests in 2-token blocks to stdout" in err


def test_an_input_that_is_not_utf8_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"token_ids": [1]}\n\xff\xfe\n')
    status, _, err = run(["convert", str(source), "-o", str(tmp_path / "t.jsonl")], capsys)
    assert status == 1 and "is not UTF-8 text" in err
    assert not (tmp_path / "t.jsonl").exists()


def test_a_tokenizer_that_cannot_be_had_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    with pytest.raises(InvalidArgumentError, match="os:sep is not a callable"):
        load_tokenizer("os:sep")

    def from_pretrained(name: str) -> None:
        raise OSError(f"{name} is not a local folder and the hub cannot be reached")

    fake_module = SimpleNamespace(AutoTokenizer=SimpleNamespace(from_pretrained=from_pretrained))
    monkeypatch.setitem(sys.modules, "transformers", fake_module)
    with pytest.raises(InvalidArgumentError, match=r"cannot load tokenizer 'org/m'.*cannot be"):
        load_tokenizer("org/m")
