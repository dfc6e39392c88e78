"""Bad input: every bad record is a WorkloadError naming file, line and field; skip_bad counts."""

import json

import pytest

from kvsim.workloads.errors import WorkloadError
from kvsim.workloads.traces import load_workload


def moon(**kw):
    return json.dumps(
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2], **kw}
    )


def kv(**kw):
    return json.dumps({"id": "a", "arrival": 0.5, "prompt": [1, 2, 3], "output_len": 2, **kw})


AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ_ROW = "2023-11-16 18:17:03.9799600,10,5\n"

CASES = [
    # (file name, content, expected message after "<path>")
    (
        "m.jsonl",
        moon() + "\n" + moon(input_length=-3) + "\n",
        ":2: field 'input_length': expected a non-negative integer, got -3",
    ),
    (
        "m.jsonl",
        moon() + "\n" + json.dumps({"timestamp": 0, "output_length": 5, "hash_ids": [1]}),
        ":2: field 'input_length': missing",
    ),
    (
        "m.jsonl",
        moon(timestamp=10) + "\n" + moon(timestamp=5) + "\n",
        ":2: field 'timestamp': timestamps must not decrease, got arrival 0.005 s after 0.01 s "
        "(line 1); sort the file by time",
    ),
    (
        "m.jsonl",
        moon(hash_ids=[1]) + "\n",
        ":1: field 'hash_ids': expected ceil(input_length/512) = 2 ids, got 1",
    ),
    (
        "m.jsonl",
        moon(hash_ids=[1, "x"]) + "\n",
        ":1: field 'hash_ids': expected a list of non-negative integers, got [1, \"x\"]",
    ),
    (
        "m.jsonl",
        moon(hash_ids=[1, 5000000]) + "\n",
        ":1: field 'hash_ids': id 5000000 too large: its tokens overflow int32 (max id 4194303)",
    ),
    (
        "m.jsonl",
        moon() + "\n\n{bad json\n",
        ":3: invalid JSON: Expecting property name enclosed in double quotes (column 2)",
    ),
    (
        "m.jsonl",
        moon(output_length=2.5) + "\n",
        ":1: field 'output_length': expected a non-negative integer, got 2.5",
    ),
    (
        "m.jsonl",
        moon(output_length=True) + "\n",
        ":1: field 'output_length': expected a non-negative integer, got true",
    ),
    (
        "a.csv",
        AZ_HEAD + AZ_ROW + "2023-11-16 18:17:04.0,-3,5\n",
        ":3: field 'ContextTokens': expected a non-negative integer, got \"-3\"",
    ),
    (
        "a.csv",
        "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,10\n",
        ":1: missing column 'GeneratedTokens' (header is TIMESTAMP,ContextTokens)",
    ),
    (
        "a.csv",
        AZ_HEAD + "yesterday,10,5\n",
        ":2: field 'TIMESTAMP': expected 'YYYY-MM-DD HH:MM:SS.f', got \"yesterday\"",
    ),
    (
        "a.csv",
        AZ_HEAD + "2023-11-16 18:17:05.0,10,5\n2023-11-16 18:17:04.0,10,5\n",
        ":3: field 'TIMESTAMP': timestamps must not decrease, got arrival -1 s after 0 s (line 2); "
        "sort the file by time",
    ),
    ("a.csv", AZ_HEAD + AZ_ROW + "2023-11-16 18:17:05.0,10\n", ":3: expected 3 columns, got 2"),
    (
        "k.jsonl",
        kv(prompt=[1, -2]) + "\n",
        ":1: field 'prompt': expected a list of token ids in [0, 2**31), got [1, -2]",
    ),
    (
        "k.jsonl",
        kv(prompt=[1, 2**31]) + "\n",
        ":1: field 'prompt': expected a list of token ids in [0, 2**31), got [1, 2147483648]",
    ),
    ("k.jsonl", kv(output=[1]) + "\n", ":1: field 'output': has 1 tokens but output_len is 2"),
    ("k.jsonl", kv(id=3) + "\n", ":1: field 'id': expected a string, got 3"),
    ("k.jsonl", kv(n=0) + "\n", ":1: field 'n': expected a positive integer, got 0"),
    (
        "k.jsonl",
        kv(arrival=-1) + "\n",
        ":1: field 'arrival': expected a non-negative number, got -1",
    ),
    (
        "k.jsonl",
        kv(think_time="x") + "\n",
        ":1: field 'think_time': expected a non-negative number, got \"x\"",
    ),
    ("k.jsonl", kv(priority=1.5) + "\n", ":1: field 'priority': expected an integer, got 1.5"),
    ("k.jsonl", kv() + "\n[1, 2]\n", ":2: expected a JSON object, got [1, 2]"),
    (
        "x.jsonl",
        json.dumps({"foo": 1}) + "\n",
        ":1: cannot tell the format from the first record (expected 'prompt' or 'hash_ids'); pass --format",
    ),
    ("x.jsonl", "", ": empty, no records"),
    (
        "x.jsonl",
        "\n{nope\n",
        ":2: cannot tell the format, the first record is not JSON (Expecting property name "
        "enclosed in double quotes, column 2); pass --format",
    ),
]


@pytest.mark.parametrize(("name", "text", "message"), CASES)
def test_bad_record_message(write, name, text, message):
    path = write(name, text)
    with pytest.raises(WorkloadError) as info:
        list(load_workload(path))
    assert str(info.value) == f"{path}{message}"


def test_workload_error_is_a_value_error():
    assert issubclass(WorkloadError, ValueError)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(WorkloadError) as info:
        load_workload(tmp_path / "nope.jsonl")
    assert str(info.value) == f"{tmp_path / 'nope.jsonl'}: no such file or directory"
    with pytest.raises(WorkloadError, match="unknown format 'parquet'"):
        load_workload(tmp_path, "parquet")


def test_skip_bad_skips_and_counts_every_pass(write):
    lines = [
        moon(timestamp=0),
        moon(input_length=-3),
        "{oops",
        moon(timestamp=5),
        moon(timestamp=2),
        moon(timestamp=9),
    ]
    wl = load_workload(write("m.jsonl", "\n".join(lines) + "\n"), skip_bad=True)
    for _ in range(2):
        assert [r.id for r in wl] == ["1", "4", "6"]
        assert wl.skipped == 3
    assert [e.split(": ", 1)[0][-2:] for e in wl.skipped_errors] == [":2", ":3", ":5"]


def test_skip_bad_azure(write):
    wl = load_workload(write("a.csv", AZ_HEAD + AZ_ROW + "bad,1,1\n" + AZ_ROW), skip_bad=True)
    assert [r.id for r in wl] == ["2", "4"] and wl.skipped == 1


def ragpulse_dir(write, trace_lines):
    write("rp/1_sys_prompt.jsonl", '{"sys_prompt_id": 10, "token_length": 4}\n')
    write("rp/2_passages.jsonl", '{"passage_id": 0, "token_length": 3}\n')
    write("rp/3_history.jsonl", '{"history_id": 20, "token_length": 2}\n')
    write("rp/4_user_input.jsonl", '{"user_input_id": 30, "token_length": 1}\n\n')
    write("rp/5_web_search.jsonl", '{"web_search_id": 40, "token_length": 5}\n')
    return write("rp/0_trace.jsonl", "\n".join(trace_lines) + "\n")


def rag(ts, length=12, **ids):
    groups = {
        "sys_prompt": [10],
        "passages_ids": [0],
        "history": [20],
        "web_search": [],
        "user_input": [30],
    }
    return json.dumps(
        {
            "timestamp": ts,
            "input_length": length,
            "output_length": 3,
            "hash_ids": {**groups, **ids},
            "session_id": "s",
        }
    )


def test_ragpulse_small_sorts_pads_and_truncates(write):
    trace = ragpulse_dir(
        write, [rag("5"), rag("1", length=8), rag("1", length=10, web_search=[40])]
    )
    reqs = list(load_workload(trace.parent))
    assert [(r.id, r.arrival) for r in reqs] == [("2", 1.0), ("3", 1.0), ("1", 5.0)]
    c = lambda cid, kind, n: [(cid * 5 + kind) * 512 + i for i in range(n)]  # noqa: E731
    # line 2: chunks sum to 4+3+2+1 = 10 > 8: truncated
    assert reqs[0].prompt.tolist() == c(10, 0, 4) + c(0, 1, 3) + [20 * 5 * 512 + 2 * 512]
    # line 3: web search chunk comes before user input; 15 > 10 so truncated
    assert reqs[1].prompt.tolist() == c(10, 0, 4) + c(0, 1, 3) + c(20, 2, 2) + c(40, 3, 1)
    # line 1: 10 tokens of chunks, then 2 filler tokens
    assert reqs[2].prompt.tolist()[-3:] == [30 * 5 * 512 + 4 * 512, 2**30, 2**30 + 1]
    assert reqs[2].session == "s"


def test_ragpulse_bad_records(write):
    trace = ragpulse_dir(write, [rag("1"), rag("two"), rag("3", user_input=[31])])
    with pytest.raises(WorkloadError) as info:
        list(load_workload(trace))
    assert (
        str(info.value)
        == f"{trace}:2: field 'timestamp': expected a non-negative number, got \"two\""
    )
    wl = load_workload(trace, skip_bad=True)
    assert [r.id for r in wl] == ["1"] and wl.skipped == 2
    assert wl.skipped_errors[1] == f"{trace}:3: field 'hash_ids': 'user_input': unknown chunk id 31"


def test_ragpulse_missing_length_file(write):
    write("rp2/0_trace.jsonl", rag("1") + "\n")
    with pytest.raises(WorkloadError) as info:
        load_workload(write("rp2/1_sys_prompt.jsonl", "").parent)
    assert str(info.value).endswith("rp2/2_passages.jsonl: missing RAGPulse chunk-length file")
