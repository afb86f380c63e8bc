"""Loaders map each dataset's layout (fixture files written here) to the one schema; bad files fail clearly."""

import gzip
import json

import pytest

from rlkv.data import verify
from rlkv.data.loaders import ProblemDataError, load_problems
from rlkv.data.records import SCHEMA_COLUMNS

VALIDATION_SEEDS, TEST_SEEDS = 1_000_003, 2_000_003  # where the splits' item seed blocks start


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _rows(ds):
    assert tuple(ds.column_names) == SCHEMA_COLUMNS
    return ds.to_list()


def test_gsm8k_answer_after_hashes(tmp_path):
    f = _jsonl(
        tmp_path / "gsm8k.jsonl",
        [
            {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            {"question": "Big?", "answer": "It is 1,000 + 234\n#### 1,234"},
        ],
    )
    assert _rows(load_problems("gsm8k", data_files=f)) == [
        {
            "problem": "Tom has 3 apples and buys 4. How many?",
            "answer": "7",
            "source": "gsm8k",
            "solution": "3 + 4 = <<3+4=7>>7",
            "metadata": "{}",
        },
        {
            "problem": "Big?",
            "answer": "1234",
            "source": "gsm8k",
            "solution": "It is 1,000 + 234",
            "metadata": "{}",
        },
    ]


@pytest.mark.parametrize(
    "name, hub_id, extra, meta",
    [
        (
            "math500",
            "HuggingFaceH4/MATH-500",
            {"subject": "Algebra", "level": 2, "unique_id": "a/1.json"},
            None,
        ),
        ("aime24", "HuggingFaceH4/aime_2024", {"id": 60, "url": "u", "year": "2024"}, None),
        ("deepscaler", "agentica-org/DeepScaleR-Preview-Dataset", {}, {}),
    ],
)
def test_math_sets_map_fields(tmp_path, name, hub_id, extra, meta):
    record = {
        "problem": "Find $x$ if $2x=1$.",
        "solution": "Divide: $x=\\frac12$.",
        "answer": "\\frac{1}{2}",
        **extra,
    }
    f = _jsonl(tmp_path / f"{name}.jsonl", [record])
    expected = {
        "problem": "Find $x$ if $2x=1$.",
        "answer": "\\frac{1}{2}",
        "source": name,
        "solution": "Divide: $x=\\frac12$.",
        "metadata": json.dumps(extra if meta is None else meta, sort_keys=True),
    }
    assert _rows(load_problems(name, data_files=f)) == [expected]
    assert _rows(load_problems(hub_id, data_files=f)) == [expected]  # hub ids are aliases
    assert verify("so \\boxed{0.5}", expected)


def test_aime_integer_answers_become_strings(tmp_path):
    f = _jsonl(tmp_path / "aime.jsonl", [{"problem": "p", "answer": 204, "solution": None}])
    assert _rows(load_problems("aime24", data_files=f))[0]["answer"] == "204"


def test_mbpp_tests_become_the_verifier(tmp_path):
    record = {
        "task_id": 2,
        "text": "Write a function to add two numbers.",
        "code": "def add(a, b):\n    return a + b",
        "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
        "test_setup_code": "",
        "challenge_test_list": [],
    }
    (row,) = _rows(load_problems("mbpp", data_files=_jsonl(tmp_path / "mbpp.jsonl", [record])))
    assert row["problem"] == (
        "Write a function to add two numbers.\nYour code should pass these tests:\n\n"
        "assert add(1, 2) == 3\nassert add(0, 0) == 0"
    )
    assert (row["answer"], row["source"], row["solution"]) == ("", "mbpp", record["code"])
    assert json.loads(row["metadata"]) == {
        "task_id": 2,
        "test_code": "assert add(1, 2) == 3\nassert add(0, 0) == 0",
    }
    assert verify(f"```python\n{record['code']}\n```", row)
    assert not verify("```python\ndef add(a, b):\n    return a * b\n```", row)


def test_humaneval_from_gz_and_from_package(tmp_path):
    record = {
        "task_id": "HumanEval/0",
        "prompt": 'def inc(x):\n    """Add one."""\n',
        "canonical_solution": "    return x + 1\n",
        "test": "def check(candidate):\n    assert candidate(1) == 2\n",
        "entry_point": "inc",
    }
    f = tmp_path / "he.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write(json.dumps(record) + "\n")
    (row,) = _rows(load_problems("humaneval", data_files=f))
    assert row["problem"] == record["prompt"] and row["source"] == "humaneval" and row["answer"] == ""
    assert row["solution"] == record["prompt"] + record["canonical_solution"]
    assert json.loads(row["metadata"]) == {
        "task_id": "HumanEval/0",
        "entry_point": "inc",
        "prefix": record["prompt"],
        "test_code": record["test"] + "\n\ncheck(inc)\n",
    }
    assert verify(record["canonical_solution"], row)
    packaged = load_problems("humaneval")
    assert len(packaged) == 164 and verify(packaged[0]["solution"], packaged[0])


def test_champ_package_layout(tmp_path):
    data = {
        "problems": {
            "P_Sequence_1": {
                "identifier": "P_Sequence_1",
                "_text": "Sum of 1..10?",
                "_answer": "55",
                "category": "Sequence",
                "solution": {"steps": [{"_text": "Use n(n+1)/2."}, {"_text": "That is 55."}]},
            }
        },
        "concepts": {},
        "hints": {},
    }
    f = tmp_path / "v0.json"
    f.write_text(json.dumps(data))
    assert _rows(load_problems("champ", data_files=f)) == [
        {
            "problem": "Sum of 1..10?",
            "answer": "55",
            "source": "champ",
            "solution": "Use n(n+1)/2. That is 55.",
            "metadata": json.dumps({"category": "Sequence", "identifier": "P_Sequence_1"}),
        }
    ]


def test_reasoning_gym_offline_seeded_and_scored():
    a = load_problems("reasoning_gym:basic_arithmetic,chain_sum", num=5, seed=3)
    b = load_problems("reasoning_gym:basic_arithmetic,chain_sum", num=5, seed=3)
    test = load_problems("reasoning_gym:basic_arithmetic,chain_sum", split="test", num=5, seed=3)
    rows = _rows(a)
    assert rows == b.to_list() and len(rows) == 5
    assert rows != test.to_list()
    tasks = [json.loads(r["metadata"])["source_dataset"] for r in rows]
    assert tasks == ["basic_arithmetic", "chain_sum", "basic_arithmetic", "chain_sum", "basic_arithmetic"]
    assert all(r["source"] == "reasoning_gym" for r in rows)
    assert all(verify(f"\\boxed{{{r['answer']}}}", r) for r in rows)


def test_reasoning_gym_held_out_split_never_shares_an_item_seed_with_the_curriculum():
    """The curriculum's pool is split "train" (the default), eval's held-out set "test": their item seeds
    lie in disjoint blocks for any seed and size that load, so no problem is generated from the same seed."""
    tasks = "reasoning_gym:basic_arithmetic,chain_sum"

    def seeds(split, seed, num):
        ds = load_problems(tasks, split=split, num=num, seed=seed)
        return {json.loads(m)["item_seed"] for m in ds["metadata"]}

    train, held_out = seeds(None, 0, 40), seeds("test", 0, 40)
    assert len(train) == len(held_out) == 40 and not train & held_out
    assert max(train) < VALIDATION_SEEDS <= min(seeds("validation", 0, 4)) < TEST_SEEDS == min(held_out)
    # the largest seed that loads stays in its block; one more would reach the next split's seeds
    top = VALIDATION_SEEDS - 7919 - 2
    assert max(seeds("train", top, 4)) == VALIDATION_SEEDS - 1
    with pytest.raises(ProblemDataError, match="item seeds of another split"):
        load_problems(tasks, num=4, seed=top + 1)


def test_excluded_problems_are_replaced_by_further_items():
    held_out = load_problems("reasoning_gym:basic_arithmetic", split="test", num=10)
    excluded = set(held_out["problem"][:3])
    again = load_problems("reasoning_gym:basic_arithmetic", split="test", num=10, exclude=excluded)
    assert len(again) == 10 and not excluded & set(again["problem"])
    assert again["problem"][:7] == held_out["problem"][3:]  # the rest in order, then the next items
    fixed = load_problems(
        "chain",
        split="test",
        num=4,
        exclude=excluded | {load_problems("chain", split="test", num=4)["problem"][0]},
    )
    assert len(fixed) == 3  # a fixed set drops them


def test_schema_files_jsonl_parquet_and_sampling(tmp_path):
    records = [{"problem": f"p{i}", "answer": str(i), "source": "gsm8k", "extra": i} for i in range(6)]
    f = _jsonl(tmp_path / "pool.jsonl", records)
    ds = load_problems(f)
    assert ds.column_names[:3] == ["problem", "answer", "source"]
    assert ds[0] == {
        "problem": "p0",
        "answer": "0",
        "source": "gsm8k",
        "extra": 0,
        "solution": "",
        "metadata": "{}",
    }
    ds.to_parquet(str(tmp_path / "pool.parquet"))
    assert load_problems(tmp_path / "pool.parquet").to_list() == ds.to_list()
    sample = load_problems(f, num=3, seed=1)
    assert len(sample) == 3 and sample.to_list() == load_problems(f, num=3, seed=1).to_list()
    assert {r["problem"] for r in sample} < {r["problem"] for r in records}


def test_bad_files_name_file_and_field(tmp_path):
    f = _jsonl(tmp_path / "nosource.jsonl", [{"problem": "p", "answer": "1"}])
    with pytest.raises(ProblemDataError, match=r"nosource\.jsonl.*record 0.*'source'"):
        load_problems(f)
    g = _jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "no hashes"}])
    with pytest.raises(ProblemDataError, match=r"gsm\.jsonl.*record 0.*'answer'.*####"):
        load_problems("gsm8k", data_files=g)
    m = _jsonl(tmp_path / "m.jsonl", [{"problem": "p", "answer": "1"}, {"question": "p"}])
    with pytest.raises(ProblemDataError, match=r"m\.jsonl.*record 1.*'problem'"):
        load_problems("math500", data_files=m)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "p"}\n{not json\n')
    with pytest.raises(ProblemDataError, match=r"bad\.jsonl:2.*not valid JSON"):
        load_problems(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ProblemDataError, match=r"empty\.jsonl.*no problems"):
        load_problems(empty)
    with pytest.raises(ProblemDataError, match=r"empty\.jsonl.*no problems"):
        load_problems("deepscaler", data_files=empty)
    with pytest.raises(ProblemDataError, match="unknown problem set 'nope'"):
        load_problems("nope")


def test_cli_show_prints_formatted_problems(capsys):
    from rlkv.cli import main

    assert main(["data", "show", "reasoning_gym:basic_arithmetic", "--num", "2", "--template", "plain"]) == 0
    printed = capsys.readouterr().out
    rows = load_problems("reasoning_gym:basic_arithmetic", num=2)
    for row in rows:
        assert f"--- source=reasoning_gym answer={row['answer']!r}" in printed
        assert row["problem"] in printed


def test_curriculum_folder_loads_its_dataset(tmp_path):
    """A `rlkv data curriculum --out` folder is a problem set: its dataset/ subfolder (recipes/demo.yaml)."""
    from datasets import Dataset

    rows = [{"problem": f"p{i}", "answer": str(i), "source": "chain", "bucket": "0-16"} for i in range(4)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "cur" / "dataset"))
    (tmp_path / "cur" / "stats.json").write_text("{}")
    ds = load_problems(tmp_path / "cur")
    assert ds.to_list() == load_problems(tmp_path / "cur" / "dataset").to_list()
    assert [r["problem"] for r in ds] == ["p0", "p1", "p2", "p3"]


def test_missing_path_says_how_to_make_it(tmp_path):
    with pytest.raises(ProblemDataError, match=r"does not exist.*rlkv data curriculum.*make demo"):
        load_problems(tmp_path / "runs" / "demo" / "curriculum")
