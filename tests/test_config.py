"""Configuration: defaults, shipped presets, DeepSpeed layouts, lenient JSON, errors, round trips."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.config import (
    AioConfig,
    Config,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
    config_to_dict,
    load_config,
)
from offload.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parent.parent
PRESETS = sorted((REPO / "configs").glob("*.json"))
KiB, MiB = 1 << 10, 1 << 20


def _write(tmp_path: pathlib.Path, text: str, name: str = "ds_config.json") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- defaults and presets -------------------------------------------------------------------------


def test_defaults_are_the_documented_values():
    """Every block's defaults are the values the docs promise (DeepSpeed's where we follow it)."""
    c = load_config(None)
    assert c == Config()
    assert c.aio == AioConfig(
        block_size=MiB, queue_depth=32, thread_count=1, single_submit=False, overlap_events=True,
        use_gds=False, backend="auto", o_direct="auto",
    )  # fmt: skip
    o = c.offload_optimizer
    assert (o.device, o.nvme_path, o.buffer_count, o.buffer_size) == ("nvme", None, 4, 64 * MiB)
    assert (o.pin_memory, o.pipeline_read, o.pipeline_write) == ("auto", True, True)
    assert (o.host_cache, o.state_dtype, o.checksum) == (0, "fp32", True)
    assert (o.small_param_threshold, o.nvme_paths) == (4096, ())
    p = c.offload_param
    assert (p.device, p.nvme_path, p.buffer_count, p.buffer_size) == ("nvme", None, 5, 100_000_000)
    assert (p.max_in_cpu, p.max_grad_in_cpu, p.pin_memory, p.checksum) == (1_000_000_000, 1_000_000_000, "auto", True)


def test_empty_sources_mean_defaults():
    """None, an empty dict and an empty JSON object all give the defaults."""
    assert load_config({}) == load_config(None) == Config()


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_shipped_preset_loads(path):
    """Each file in configs/ loads without error."""
    assert isinstance(load_config(path), Config)


def test_the_documented_presets_are_shipped():
    """configs/ holds the default, the DeepSpeed examples and the tiny preset."""
    assert {"default.json", "deepspeed_example.json", "ds_config_70b.json", "tiny.json"} <= {p.name for p in PRESETS}


def test_default_preset_equals_the_builtin_defaults():
    """configs/default.json spells out exactly the dataclasses' defaults."""
    assert load_config(REPO / "configs" / "default.json") == Config()


def test_tiny_preset_has_small_buffers():
    """configs/tiny.json keeps blocks and pool buffers small enough for quick tests."""
    c = load_config(str(REPO / "configs" / "tiny.json"))
    assert (c.aio.block_size, c.aio.queue_depth) == (64 * KiB, 8)
    assert (c.offload_optimizer.buffer_size, c.offload_optimizer.buffer_count) == (MiB, 4)


def test_deepspeed_example_reads_the_zero_blocks_and_aio():
    """The DeepSpeed example's offload blocks, its aio block and its 1e8-style counts are read."""
    c = load_config(REPO / "configs" / "deepspeed_example.json")
    assert c.aio.queue_depth == 8 and c.aio.thread_count == 1
    assert c.offload_optimizer.nvme_path == "/local_nvme" and c.offload_optimizer.pin_memory is True
    assert c.offload_param.buffer_size == 100_000_000 and c.offload_param.max_in_cpu == 1_000_000_000


# --- DeepSpeed layouts and lenient JSON -----------------------------------------------------------

DS_BODY = {
    "train_batch_size": 16,
    "fp16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    "scheduler": {"type": "WarmupLR"},
    "zero_optimization": {
        "stage": 3,
        "stage3_prefetch_bucket_size": "auto",
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 6},
        "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_size": 2e8},
    },
}


def test_aio_at_top_level_of_a_deepspeed_config_is_read():
    """A ds_config with aio at the top level gives that aio block and the zero_optimization offload blocks."""
    c = load_config({**DS_BODY, "aio": {"block_size": 262144, "queue_depth": 4}})
    assert (c.aio.block_size, c.aio.queue_depth) == (262144, 4)
    assert c.offload_optimizer.buffer_count == 6 and c.offload_param.buffer_size == 200_000_000


def test_aio_inside_zero_optimization_is_read():
    """Examples that nest aio inside zero_optimization load the same as with aio at the top level."""
    nested = {**DS_BODY, "zero_optimization": {**DS_BODY["zero_optimization"], "aio": {"queue_depth": 4}}}
    assert load_config(nested) == load_config({**DS_BODY, "aio": {"queue_depth": 4}})


def test_aio_given_identically_in_both_places_is_accepted():
    """The same aio block at the top level and inside zero_optimization is not a conflict."""
    aio = {"queue_depth": 4}
    doc = {"aio": aio, "zero_optimization": {"aio": dict(aio)}}
    assert load_config(doc).aio.queue_depth == 4


def test_unrelated_deepspeed_keys_are_ignored():
    """train_batch_size, fp16, optimizer, scheduler, zero_optimization.stage... change and break nothing."""
    assert load_config(DS_BODY) == load_config({"zero_optimization": {
        k: DS_BODY["zero_optimization"][k] for k in ("offload_optimizer", "offload_param")}})  # fmt: skip


def test_intra_op_parallelism_is_thread_count():
    """DeepSpeed's newer name intra_op_parallelism sets thread_count; both with one value is fine."""
    assert load_config({"aio": {"intra_op_parallelism": 4}}).aio.thread_count == 4
    assert load_config({"intra_op_parallelism": 3, "thread_count": 3}).aio.thread_count == 3


def test_a_bare_aio_block_is_read():
    """A mapping of aio keys only (no "aio" wrapper) is read as an aio block."""
    c = load_config({"block_size": "256KiB", "queue_depth": 16, "single_submit": True})
    assert (c.aio.block_size, c.aio.queue_depth, c.aio.single_submit) == (256 * KiB, 16, True)
    assert c.offload_optimizer == OptimizerOffloadConfig()


def test_comments_and_trailing_commas_are_accepted_in_an_hjson_file(tmp_path):
    """In a .hjson file //, /* */ and # comments and trailing commas in objects and lists are read, as hjson
    (and DeepSpeed) reads them."""
    text = """
    // leading comment
    {
      /* block
         comment */
      "aio": {"queue_depth": 16, /* inline */ "block_size": 8192,},  # hash comment
      "zero_optimization": {
        "offload_optimizer": {"nvme_path": ["/a", "/b",], },
      },
    }
    """
    c = load_config(_write(tmp_path, text, "ds_config.hjson"))
    assert (c.aio.queue_depth, c.aio.block_size) == (16, 8192)
    assert c.offload_optimizer.nvme_path == ("/a", "/b")


def test_strings_containing_comment_markers_are_left_intact(tmp_path):
    """Markers "//", "/*", "#" and ",}" inside strings (paths, URLs) are data, not comments or commas."""
    text = r"""{
      "offload_optimizer": {"nvme_path": "/mnt//nvme/*run#1*/,}"},  // real comment
      "offload_param": {"nvme_path": "C:\\dir\\\"quoted\"//x"},
      "wandb": {"url": "https://example.com/a,]"},
    }"""
    c = load_config(_write(tmp_path, text, "ds_config.hjson"))
    assert c.offload_optimizer.nvme_path == "/mnt//nvme/*run#1*/,}"
    assert c.offload_param.nvme_path == 'C:\\dir\\"quoted"//x'


def test_what_deepspeed_reads_through_hjson_loads_the_same(tmp_path):
    """hjson's relaxations load as DeepSpeed reads them: members separated by newlines alone, unquoted keys
    and strings, a UTF-8 byte order mark, and whole-number floats below 1e10 read as integers."""
    text = (
        '{\n  aio: {\n    "queue_depth": 8.0\n    "block_size": 4096\n  }\n'
        "  offload_param: {nvme_path: /mnt/nvme 0\n  buffer_size: 2e8}\n}"
    )
    path = tmp_path / "ds_config.hjson"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    c = load_config(path)
    assert (c.aio.queue_depth, c.aio.block_size) == (8, 4096)
    assert (c.offload_param.nvme_path, c.offload_param.buffer_size) == ("/mnt/nvme 0", 200_000_000)


@pytest.mark.parametrize("text, where, what", [
    ('{"zero_optimization": {"offload_optimizer": {"nvme_path": "/x"\n "buffer_count": 4}}}', "line 2, column 2",
     "Expecting ',' delimiter"),
    ('{\n  // a comment\n  "aio": {}\n}', "line 2, column 3", "Expecting property name"),
    ('{"aio": {"queue_depth": 8,}}', "line 1, column 27", "Expecting property name"),
    ('{"offload_param": {\n"nvme_path": local_nvme\n}}', "line 2, column 14", "Expecting value"),
])
def test_a_json_file_is_strict_json_and_says_where_and_that_hjson_is_for_hjson_files(tmp_path, text, where, what):
    """A .json file is held to JSON: a missing comma, a comment, a trailing comma or an unquoted string is an error
    with its line and column, saying that the text would read as hjson under a .hjson name; the same text in a
    .hjson file loads, as DeepSpeed reads it."""
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text, "ds_config.json"))
    message = str(info.value)
    assert f"invalid JSON at {where}: {what}" in message and "rename the file to *.hjson" in message
    assert isinstance(load_config(_write(tmp_path, text, "ds_config.hjson")), Config)


def test_json_numbers_mean_what_they_mean_in_hjson(tmp_path):
    """Whole numbers written with a fraction or exponent (8.0, 1e8) are integers in a .json file as in a .hjson
    one, so a setting means the same in either; NaN and Infinity are not JSON numbers."""
    text = '{"aio": {"queue_depth": 8.0}, "offload_param": {"buffer_size": 2e8, "max_in_cpu": 1e9}}'
    a, b = load_config(_write(tmp_path, text, "a.json")), load_config(_write(tmp_path, text, "a.hjson"))
    assert a == b and (a.aio.queue_depth, a.offload_param.buffer_size) == (8, 200_000_000)
    with pytest.raises(ConfigError, match="NaN is not a JSON number"):
        load_config(_write(tmp_path, '{"aio": {"queue_depth": NaN}}', "nan.json"))
    with pytest.raises(ConfigError, match="empty"):
        load_config(_write(tmp_path, " \n", "empty.json"))


def test_a_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path):
    """Latin-1 or UTF-16 text is a ConfigError naming the file, the byte, its line and column, and the fix."""
    latin1 = _write(tmp_path, "", "latin1.json")
    latin1.write_bytes('{\n  "aio": {},\n  "note": "café"\n}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.json: not UTF-8 text: byte 0xe9 at line 3, column 15 .*"
                                          r"save the file as UTF-8"):
        load_config(latin1)
    utf16 = _write(tmp_path, "", "utf16.json")
    utf16.write_bytes('{"aio": {}}'.encode("utf-16"))
    with pytest.raises(ConfigError, match=r"utf16\.json: not UTF-8 text: byte 0x(ff|fe) at line 1, column 1"):
        load_config(utf16)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a": ' * 100_000, '{"a": [' * 50_000])
def test_deep_nesting_is_a_config_error_naming_the_file(tmp_path, text):
    """A document nested far beyond any configuration is a ConfigError naming the file, not a RecursionError."""
    with pytest.raises(ConfigError, match=r"deep\.json: objects or lists are nested too deeply"):
        load_config(_write(tmp_path, text, "deep.json"))


def test_a_syntax_error_in_a_long_line_quotes_only_its_neighbourhood(tmp_path):
    """A syntax error on a megabyte-long line quotes about 100 characters around the column, caret included."""
    text = '{"aio": {' + '"x": 1, ' * 125_000 + '"y" 2}}'
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    message = str(info.value)
    assert len(message) < 400 and "Expecting ':' delimiter" in message
    quoted, caret = message.splitlines()[-2:]
    assert quoted[len(caret) - 1:] == "2}}" and quoted.endswith('"y" 2}}'), (quoted, caret)


_TOKENS = ['{', '}', '[', ']', ':', ',', '"', "'", "'''", "/*", "*/", "//", "#", "\n", " ", "\\", "\\u", "a",
           "-", "0", "1e309", "9" * 30, ".", "e", "true", "null", "aio", '"aio"', "\r", "\x00", "é"]  # fmt: skip


@pytest.mark.parametrize("suffix", [".json", ".hjson"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(_TOKENS), max_size=30).map("".join))
def test_any_text_loads_or_raises_config_error(tmp_path, suffix, text):
    """Whatever a file holds, JSON or hjson, load_config returns a Config or raises ConfigError: no parser
    exception escapes."""
    path = tmp_path / f"fuzz{suffix}"
    path.write_text(text, encoding="utf-8")
    try:
        assert isinstance(load_config(path), Config)
    except ConfigError as err:
        assert str(path) in str(err)


def test_human_sizes_and_counts_are_read():
    """Byte sizes take "64MiB"-style strings; element counts take 1e8 and "100M"."""
    c = load_config({
        "aio": {"block_size": "4 KiB"},
        "offload_optimizer": {"buffer_size": "128MiB", "small_param_threshold": "10K"},
        "offload_param": {"buffer_size": "50M", "max_in_cpu": 2e9},
    })  # fmt: skip
    assert c.aio.block_size == 4096 and c.offload_optimizer.buffer_size == 128 * MiB
    assert c.offload_optimizer.small_param_threshold == 10_000
    assert (c.offload_param.buffer_size, c.offload_param.max_in_cpu) == (50_000_000, 2_000_000_000)


@pytest.mark.parametrize(
    ("block", "key", "expected"),
    [
        ("aio", "block_size", MiB),
        ("aio", "queue_depth", 32),
        ("aio", "thread_count", 1),
        ("aio", "backend", "auto"),
        ("aio", "o_direct", "auto"),
        ("offload_optimizer", "buffer_count", 4),
        ("offload_optimizer", "buffer_size", 64 * MiB),
        ("offload_param", "buffer_size", 100_000_000),
        ("offload_param", "max_in_cpu", 1_000_000_000),
    ],
)
def test_auto_in_a_numeric_key_means_its_default(block, key, expected):
    """HF-style "auto" in a tuning number (or in backend/o_direct, where it is a value) gives the default."""
    c = load_config({block: {key: "auto"}})
    assert getattr(getattr(c, block), key) == expected


def test_other_sources_pass_through():
    """A Config is returned as is, an AioConfig is wrapped, and a path may be a str or a PathLike."""
    c = Config(aio=AioConfig(queue_depth=2))
    assert load_config(c) is c
    assert load_config(AioConfig(queue_depth=2)) == c


# --- errors, as a table ---------------------------------------------------------------------------

CE = ConfigError
BAD = [
    # (source: a dict, or ("file", text), exception, message pattern)
    ({"aio": {"blok_size": 4096}}, CE, r'aio\.blok_size: unknown key in "aio"; did you mean "block_size"'),
    ({"aio": {"queue_dept": 4}}, CE, r'did you mean "queue_depth"'),
    ({"offload_optimizer": {"bufer_count": 4}}, CE, r'offload_optimizer\.bufer_count.*"buffer_count"'),
    ({"offload_param": {"max_in_gpu": 1}}, CE, r'offload_param\.max_in_gpu.*did you mean "max_in_cpu"'),
    ({"aio": {"zzz": 1}}, CE, r'unknown key in "aio"; valid keys: block_size, queue_depth'),
    ({"aio": {"buffer_count": 4}}, CE, r'aio\.buffer_count: .*a key of "offload_optimizer"'),
    ({"queue_dept": 4, "block_size": 4096}, CE, r'aio\.queue_dept.*did you mean "queue_depth"'),
    ({"aio": {"queue_depth": True}}, CE, r"aio\.queue_depth: must be an integer.*true \(a boolean\)"),
    ({"aio": {"queue_depth": "8"}}, CE, r'aio\.queue_depth: must be an integer.*"8" \(a string\)'),
    ({"aio": {"queue_depth": 8.0}}, CE, r"aio\.queue_depth: must be an integer.*8\.0 \(a float\)"),
    ({"aio": {"single_submit": "yes"}}, CE, r'aio\.single_submit: must be true or false, got "yes"'),
    ({"aio": {"overlap_events": 1}}, CE, r"aio\.overlap_events: must be true or false, got 1"),
    ({"aio": {"block_size": 1048576.0}}, CE, r"aio\.block_size: .*1048576\.0 \(a float\)"),
    ({"aio": {"block_size": 5000}}, CE, r"aio\.block_size: must be a multiple of 4096.*try 4096 or 8192"),
    ({"aio": {"block_size": 0}}, CE, r"aio\.block_size: must be between 4096 and"),
    ({"aio": {"block_size": "2GiB"}}, CE, r"aio\.block_size: must be between 4096 and .*1\.00 GiB"),
    ({"aio": {"block_size": "1.5.3M"}}, CE, r"aio\.block_size: invalid size '1\.5\.3M'"),
    ({"aio": {"queue_depth": 0}}, CE, r"aio\.queue_depth: must be between 1 and 4096, got 0"),
    ({"aio": {"queue_depth": 4097}}, CE, r"aio\.queue_depth: must be between 1 and 4096"),
    ({"aio": {"thread_count": 65}}, CE, r"aio\.thread_count: must be between 1 and 64"),
    ({"aio": {"backend": "uring"}}, CE, r'aio\.backend: must be one of .*did you mean "io_uring"'),
    ({"aio": {"o_direct": "true"}}, CE, r'aio\.o_direct: must be "auto", true or false \(without quotes'),
    ({"aio": {"thread_count": 2, "intra_op_parallelism": 4}}, CE, r"mean the same \(thread_count\)"),
    ({"offload_optimizer": {"buffer_count": 1}}, CE, r"offload_optimizer\.buffer_count: must be at least 2"),
    ({"offload_param": {"buffer_count": 1}}, CE, r"offload_param\.buffer_count: must be at least 2"),
    ({"offload_optimizer": {"buffer_size": "1000KB"}}, CE, r"buffer_size: must be a multiple of 4096"),
    ({"offload_optimizer": {"ratio": 0.5}}, CE, r"ratio: only 1\.0 is supported, got 0\.5: all optimizer"),
    ({"offload_optimizer": {"ratio": 1.5}}, CE, r"ratio: must be in \(0, 1\], got 1\.5"),
    ({"offload_optimizer": {"ratio": 0}}, CE, r"ratio: must be in \(0, 1\], got 0\.0"),
    ({"offload_optimizer": {"device": "gpu"}}, CE, r'device: must be one of "nvme", "cpu", "none"'),
    ({"offload_optimizer": {"device": "NVMe"}}, CE, r'did you mean "nvme"'),
    ({"offload_optimizer": {"nvme_path": []}}, CE, r"nvme_path: must not be an empty list"),
    ({"offload_optimizer": {"nvme_path": ""}}, CE, r"nvme_path: must not be empty"),
    ({"offload_optimizer": {"nvme_path": ["/a", "/a"]}}, CE, r"nvme_path: lists '/a' more than once"),
    ({"offload_optimizer": {"nvme_path": 5}}, CE, r"nvme_path: must be a directory .*got 5"),
    ({"offload_param": {"buffer_size": 1.5e3 + 0.5}}, CE, r"offload_param\.buffer_size: .*whole number"),
    ({"offload_param": {"buffer_size": 0}}, CE, r"offload_param\.buffer_size: must be at least 1"),
    ({"offload_param": {"max_in_cpu": -1}}, CE, r"offload_param\.max_in_cpu: must be at least 0"),
    # HF-style "auto" where no default is safe
    ({"offload_optimizer": {"pipeline_read": "auto"}}, CE, r'offload_optimizer\.pipeline_read: "auto" is not'),
    ({"offload_optimizer": {"pin_memory": "yes"}}, CE, r'offload_optimizer\.pin_memory: must be "auto", true or false'),
    ({"offload_optimizer": {"host_cache": "-1GiB"}}, CE, r"offload_optimizer\.host_cache: .*negative"),
    ({"offload_optimizer": {"host_cache": "lots"}}, CE, r'offload_optimizer\.host_cache: .*or write "auto"'),
    ({"offload_optimizer": {"state_dtype": "fp16"}}, CE, r'state_dtype: must be one of "fp32", "bf16"'),
    ({"offload_param": {"max_grad_in_cpu": -1}}, CE, r"offload_param\.max_grad_in_cpu: must be at least 0"),
    ({"offload_param": {"device": "auto"}}, CE, r'offload_param\.device: "auto" is not accepted.*"nvme"'),
    ({"offload_optimizer": {"nvme_path": "auto"}}, CE, r'nvme_path: "auto" is not accepted.*directory'),
    # several problems at once, each with its JSON path
    (
        {"aio": {"queue_depth": 0, "blok_size": 1},
         "zero_optimization": {"offload_optimizer": {"buffer_count": 1}}},
        CE,
        r"(?s)\(3 problems\).*aio\.queue_depth.*aio\.blok_size"
        r".*zero_optimization\.offload_optimizer\.buffer_count",
    ),
    # layout problems
    ({"aio": 5}, CE, r"aio: must be an object of aio settings, got 5"),
    ({"zero_optimization": []}, CE, r"zero_optimization: must be an object"),
    ({"offload_optimiser": {}}, CE, r'offload_optimiser: unknown top-level key; did you mean "offload_optim'),
    ({"zero_optimization": {"offload_params": {}}}, CE, r'did you mean "offload_param"'),
    ({"aio": {}, "queue_depth": 8}, CE, r'queue_depth: belongs inside "aio"'),
    ({"queue_dept": 8}, CE, r'queue_dept: unknown top-level key; did you mean "queue_depth"'),
    (
        {"aio": {"queue_depth": 8}, "zero_optimization": {"aio": {"queue_depth": 4}}},
        CE,
        r"zero_optimization\.aio: aio is also given at the top level, differently",
    ),
    # file syntax
    (("file", '{\n  "aio": {\n    "queue_depth": 8,\n    "block_size" 4096\n  }\n}'), CE,
     r"ds_config\.json: invalid JSON at line 4, column 18: Expecting ':' delimiter\n"
     r'        "block_size" 4096\n {21}\^'),
    (("file", '{"aio": {"queue_depth": 8, "queue_depth": 4}}'), CE,
     r"ds_config\.json.*aio\.queue_depth: duplicate key"),
    (("file", '{"fp16": {"enabled": true, "enabled": false}}'), CE, r"fp16\.enabled: duplicate key"),
    (("hjson", '{"aio": {}\n /* never closed'), CE, r"unterminated /\* comment at line 2, column 2"),
    (("file", "[1, 2]"), CE, r"the top level must be a JSON object"),
    (("file", ""), CE, r"invalid JSON at line 1, column 1"),
    (("hjson", "// only a comment\n"), CE, r"no JSON value .*write \{\} for all defaults"),
    (("file", '{"aio": {"queue_depth": 8}}\n{"aio": {}}'), CE, r"line 2, column 1: Extra data"),
    (("file", '{"offload_param": {"buffer_size": 1e999}}'), CE, r"line 1, column 35: the number 1e999 is out"),
    (("file", '{"n": ' + "9" * 5000 + "}"), CE, r"the number 99999.* \(5000 characters\) is out of range"),
    (("file", '{"a": "\\u\r\n-f"}'), CE, r"ds_config\.json: invalid JSON"),
    (("hjson", "{'a': " + "'" * 3), CE, r"line 1, column 10: the file ends inside a multiline '{3} string"),
    (("hjson", '{"p": "/a/*b",\n "aio": {} /* x'), CE, r"unterminated /\* comment at line 1, column 10"),
    # values beyond what any machine or type holds, from files and mappings
    (("file", '{"offload_param": {"buffer_size": 1e300}}'), CE,
     r"offload_param\.buffer_size: must be at most 9223372036854775807 \(the largest int64\), got 1\.00e\+300"),
    ({"offload_param": {"max_in_cpu": 2**63}}, CE, r"offload_param\.max_in_cpu: must be at most 9223372036854775807"),
    ({"offload_optimizer": {"small_param_threshold": "1e30"}}, CE, r"small_param_threshold: must be at most"),
    ({"offload_optimizer": {"buffer_count": 10**6}}, CE,
     r"offload_optimizer\.buffer_count: must be at most 4096 \(the pool is buffer_count x buffer_size"),
    ({"offload_param": {"buffer_count": 4097}}, CE, r"offload_param\.buffer_count: must be at most 4096"),
    ({"offload_optimizer": {"buffer_size": "8EiB"}}, CE,
     r"offload_optimizer\.buffer_size: must be at most 8\.00 EiB \(the largest aligned int64 byte count\)"),
    ({"offload_optimizer": {"buffer_size": 1e300}}, CE, r"buffer_size: must be a number of bytes .*1e\+300"),
    ({"offload_optimizer": {"buffer_size": 2**70}}, CE, r"buffer_size: must be at most .*got 1\.18e\+21"),
    # not a config source at all
    (42, TypeError, r"load_config expects None, a Config"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "error", "pattern"), BAD)
def test_bad_input_raises_with_a_message_naming_the_problem(tmp_path, source, error, pattern):
    """Each bad input raises the listed exception, whose message names the key (by JSON path) and the fix."""
    if isinstance(source, tuple):
        source = _write(tmp_path, source[1], "ds_config.json" if source[0] == "file" else "ds_config.hjson")
    with pytest.raises(error, match=pattern):
        load_config(source)


def test_config_error_is_a_value_error_with_each_problem_listed():
    """ConfigError is also a ValueError, and .problems pairs each JSON path with its message."""
    with pytest.raises(ValueError) as info:
        load_config({"aio": {"queue_depth": 0, "thread_count": 0}})
    assert isinstance(info.value, ConfigError)
    assert [path for path, _ in info.value.problems] == ["aio.queue_depth", "aio.thread_count"]


def test_a_missing_file_is_an_os_error(tmp_path):
    """A config path that does not exist raises FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_config(tmp_path / "nope.json")


# --- the dataclasses ------------------------------------------------------------------------------


def test_constructors_report_every_bad_field_at_once():
    """Building a block directly checks every field and names each bad one in one ConfigError."""
    with pytest.raises(ConfigError, match=r"(?s)2 problems.*aio\.block_size.*aio\.queue_depth"):
        AioConfig(queue_depth=0, block_size=100)
    with pytest.raises(ConfigError, match=r"offload_param\.buffer_count"):
        ParamOffloadConfig(buffer_count=0)


def test_constructors_are_strict_about_types():
    """Python construction takes exact types: no human-size strings, no 1 for True."""
    with pytest.raises(ConfigError, match="block_size: must be an integer number of bytes"):
        AioConfig(block_size="1MiB")
    with pytest.raises(ConfigError, match='pin_memory: must be "auto", true or false'):
        OptimizerOffloadConfig(pin_memory=1)


def test_constructors_normalize_numpy_ints_and_path_lists(tmp_path):
    """numpy ints become ints and path lists (str or PathLike) become tuples, so blocks hash and compare."""
    a = AioConfig(block_size=np.int64(8192))
    assert type(a.block_size) is int and a == AioConfig(block_size=8192)
    o = OptimizerOffloadConfig(nvme_path=[tmp_path / "a", str(tmp_path / "b")])
    assert o.nvme_path == (str(tmp_path / "a"), str(tmp_path / "b")) and o.nvme_paths == o.nvme_path
    assert hash(o) == hash(OptimizerOffloadConfig(nvme_path=o.nvme_path))


def test_replace_variants_are_validated():
    """dataclasses.replace and the replace methods make variants, each checked like a fresh construction."""
    base = load_config(REPO / "configs" / "tiny.json")
    assert dataclasses.replace(base.aio, queue_depth=2).queue_depth == 2
    assert base.aio.replace(backend="threads").backend == "threads"
    with pytest.raises(ConfigError, match="queue_depth"):
        base.aio.replace(queue_depth=0)
    c = base.replace(offload_optimizer={"buffer_size": "2MiB", "nvme_path": ["/x", "/y"]})
    assert c.offload_optimizer.buffer_size == 2 * MiB and c.offload_optimizer.nvme_paths == ("/x", "/y")
    assert c.offload_optimizer.buffer_count == base.offload_optimizer.buffer_count and c.aio == base.aio
    assert base.replace(aio={"intra_op_parallelism": 3}).aio.thread_count == 3
    with pytest.raises(ConfigError, match=r'offload_optimizer\.bufer_size.*did you mean "buffer_size"'):
        base.replace(offload_optimizer={"bufer_size": 1})
    with pytest.raises(ConfigError, match=r'aoi: unknown block; did you mean "aio"'):
        base.replace(aoi={})


def test_config_takes_blocks_as_mappings():
    """Config(aio={...}) reads the mapping with the loader's rules (human sizes)."""
    assert Config(aio={"block_size": "256KiB"}).aio.block_size == 256 * KiB
    with pytest.raises(ConfigError, match="aio: must be an AioConfig or a mapping"):
        Config(aio=5)


def test_config_package_imports_neither_the_engine_nor_torch():
    """offload/config/ and sizes.py import only the standard library, hjson, offload.errors/sizes/regular and
    each other: no native code, no torch, no other layer."""
    package = sorted((REPO / "offload" / "config").glob("*.py"))
    own = {p.stem for p in package}
    assert {"__init__", "rules", "blocks", "loader"} <= own
    for path in [*package, REPO / "offload" / "sizes.py"]:
        in_package = path.parent.name == "config"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                # In the package ".x" is a sibling and "..x" is offload.x; in sizes.py ".x" is offload.x.
                sibling = in_package and node.level == 1
                allowed = own if sibling else {"errors", "sizes", "regular"}
                assert node.module in allowed and node.level <= 1 + in_package, f"{path.name}: {node.module}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert not any(re.match(r"(torch|offload|numpy|cffi|psutil)\b", m) for m in mods), mods


# --- round trips ----------------------------------------------------------------------------------


def test_config_to_dict_round_trips_through_json(tmp_path):
    """config_to_dict -> json file -> load_config gives back an equal Config, for every block."""
    c = Config(
        aio=AioConfig(block_size=256 * KiB, queue_depth=7, thread_count=3, single_submit=True,
                      overlap_events=False, backend="threads", o_direct=False),
        offload_optimizer=OptimizerOffloadConfig(nvme_path=("/a", "/b"), buffer_count=3, buffer_size=8 * MiB,
                                                 pin_memory=True, pipeline_read=False,
                                                 small_param_threshold=0),
        offload_param=ParamOffloadConfig(device="cpu", nvme_path="/p", buffer_count=2, buffer_size=10,
                                         max_in_cpu=0, pin_memory=True),
    )  # fmt: skip
    path = _write(tmp_path, json.dumps(config_to_dict(c, only=None)), "all.json")
    assert load_config(path) == c


def test_config_to_dict_emits_only_the_asked_blocks_with_json_types():
    """The default only=("aio",) gives {"aio": {...}} with real booleans, which loads back to that aio."""
    aio = AioConfig(queue_depth=16, o_direct=True)
    d = config_to_dict(Config(aio=aio))
    assert list(d) == ["aio"] and d["aio"]["o_direct"] is True and d["aio"]["use_gds"] is False
    assert load_config(json.loads(json.dumps({"aio": d["aio"]}))) == Config(aio=aio)
    assert list(config_to_dict(OptimizerOffloadConfig())) == ["offload_optimizer"]
    with pytest.raises(ValueError, match="unknown block"):
        config_to_dict(Config(), only=("aoi",))


_sizes = st.integers(min_value=1, max_value=1 << 18).map(lambda n: n * 4096)
_aio_values = {
    "block_size": st.one_of(_sizes, _sizes.map(lambda n: f"{n // KiB}KiB"), _sizes.map(lambda n: f"{n} B")),
    "queue_depth": st.integers(min_value=1, max_value=4096),
    "thread_count": st.integers(min_value=1, max_value=64),
    "intra_op_parallelism": st.integers(min_value=1, max_value=64),
    "single_submit": st.booleans(),
    "overlap_events": st.booleans(),
    "use_gds": st.booleans(),
    "backend": st.sampled_from(["auto", "io_uring", "threads"]),
    "o_direct": st.sampled_from(["auto", True, False]),
}
_aio_blocks = st.fixed_dictionaries({}, optional=_aio_values).filter(
    lambda b: not ("thread_count" in b and "intra_op_parallelism" in b)
)


@settings(max_examples=200, deadline=None)
@given(_aio_blocks, st.booleans())
def test_random_valid_aio_blocks_round_trip(block, wrapped):
    """Any valid aio block (bare or wrapped) loads, and config_to_dict -> JSON -> load_config returns it."""
    c = load_config({"aio": block} if wrapped else block)
    for key, value in block.items():
        field_name = "thread_count" if key == "intra_op_parallelism" else key
        expected = value
        if key == "block_size" and isinstance(value, str):
            expected = int(value[:-3]) * KiB if value.endswith("KiB") else int(value[:-2])
        assert getattr(c.aio, field_name) == expected
    assert load_config(json.loads(json.dumps(config_to_dict(c)))) == c


def test_offload_config_applies_overrides_with_loader_rules_and_checks_use(tmp_path):
    """offload_config reads a bare block, applies PathLike and human-size overrides, and refuses
    a non-NVMe device or a missing path with a message saying what to do."""
    from offload.config import offload_config

    kw = dict(user="Thing", what="state", otherwise="or keep it in memory")
    cfg = offload_config({"buffer_count": 3}, "offload_optimizer", nvme_path=[tmp_path / "a", str(tmp_path / "b")],
                         buffer_size="1MiB", **kw)
    oc = cfg.offload_optimizer
    assert (oc.buffer_count, oc.buffer_size) == (3, 1 << 20)
    assert oc.nvme_paths == (str(tmp_path / "a"), str(tmp_path / "b"))
    with pytest.raises(ConfigError, match=r'Thing keeps state on "nvme" or "cpu".*\(or keep it in memory\)'):
        offload_config({"device": "none"}, "offload_optimizer", nvme_path=str(tmp_path), **kw)
    with pytest.raises(ConfigError, match=r'Thing keeps state on "nvme"\. Set it to "nvme"'):
        offload_config({"device": "cpu"}, "offload_param", nvme_path=str(tmp_path), **kw)
    assert offload_config({"device": "cpu"}, "offload_optimizer", **kw).offload_optimizer.device == "cpu"
    with pytest.raises(ConfigError, match="nvme_path is required.*offload_param.nvme_path"):
        offload_config(None, "offload_param", **kw)
    with pytest.raises(ConfigError, match="buffer_count"):
        offload_config(None, "offload_param", nvme_path=str(tmp_path), buffer_count=1, **kw)


def test_tier_keys_read_human_sizes_and_auto():
    """host_cache takes bytes, human sizes and "auto"; state_dtype, checksum, max_grad_in_cpu and pin_memory
    "auto" are read as written."""
    c = load_config({"offload_optimizer": {"host_cache": "48GiB", "state_dtype": "bf16", "checksum": True,
                                           "pin_memory": "auto", "device": "cpu"},
                     "offload_param": {"max_grad_in_cpu": "1e8"}})
    oc = c.offload_optimizer
    assert (oc.host_cache, oc.state_dtype, oc.checksum, oc.pin_memory, oc.device) == (48 << 30, "bf16", True, "auto",
                                                                                      "cpu")
    assert c.offload_param.max_grad_in_cpu == 100_000_000
    assert load_config({"offload_optimizer": {"host_cache": "auto"}}).offload_optimizer.host_cache == "auto"


# --- GPUDirect Storage (aio.use_gds) --------------------------------------------------------------


@pytest.fixture
def fresh_gds(monkeypatch):
    """The gds module as in a new process: no warning given yet, availability not yet asked (and the
    cached answer dropped again after the test, which may have faked the machine)."""
    from offload.aio import gds

    status = gds.gds_status
    monkeypatch.setattr(gds, "_warned", False)
    status.cache_clear()
    yield gds
    status.cache_clear()


def _fake_kvikio(monkeypatch, *, compat=False, gds=True, broken=None, api="get"):
    """Put a stand-in kvikio (version 26.10.0, cuFile 1.15) in sys.modules, and a CUDA device in torch. ``api``:
    how it gives the cuFile driver's properties, as kvikio's releases did: ``"get"`` (25.04 on:
    ``kvikio.cufile_driver.get``), ``"properties"`` (24.12: ``cufile_driver.properties``), ``"class"``
    (``cufile_driver.DriverProperties``), ``"top"`` (before 24.12: ``kvikio.DriverProperties``, no
    ``kvikio.cufile_driver``; ``defaults.compat_mode()`` instead of ``is_compat_mode_preferred``)."""
    import importlib.machinery
    import sys
    import types

    import torch

    kvikio = types.ModuleType("kvikio")
    kvikio.__spec__ = importlib.machinery.ModuleSpec("kvikio", None)
    kvikio.__version__ = "26.10.0"
    defaults = types.ModuleType("kvikio.defaults")
    defaults.is_compat_mode_preferred = lambda: compat
    driver = types.ModuleType("kvikio.cufile_driver")
    values = {"is_gds_available": gds, "major_version": 1, "minor_version": 15}
    props = type("DriverProperties", (), values)
    if api == "get":
        driver.get = values.__getitem__
    elif api == "properties":
        driver.properties = props()
    elif api == "class":
        driver.DriverProperties = props
    else:
        kvikio.DriverProperties = props
        driver = None  # import kvikio.cufile_driver raises ImportError
        del defaults.is_compat_mode_preferred
        defaults.compat_mode = lambda: compat
    if broken is not None:
        def fail():
            raise broken
        defaults.is_compat_mode_preferred = fail
    for name, module in (("kvikio", kvikio), ("kvikio.defaults", defaults), ("kvikio.cufile_driver", driver)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_use_gds_true_loads_from_files_mappings_and_the_dataclass():
    """use_gds true (the seed's 70B config sets it) is read, kept and written back, not refused."""
    assert load_config({"aio": {"use_gds": True}}).aio.use_gds is True
    assert AioConfig(use_gds=True).use_gds is True
    c = load_config(REPO / "configs" / "ds_config_70b.json")
    assert c.aio.use_gds is True
    assert load_config(config_to_dict(c)) == Config(aio=c.aio)
    with pytest.raises(ConfigError, match=r'aio\.use_gds: must be true or false, got "yes"'):
        load_config({"aio": {"use_gds": "yes"}})


def test_gds_status_here_says_why_not_in_one_line(fresh_gds):
    """Without kvikio (this machine) or without a GPU, gds_status is (False, a one-line reason naming what
    is missing and how to get it); it never raises."""
    import importlib.util

    import torch

    ok, reason = fresh_gds.gds_status()
    assert ok is False and "\n" not in reason
    if importlib.util.find_spec("kvikio") is None:
        assert "kvikio package is not installed" in reason and "nvme-offload[gds]" in reason
    elif not torch.cuda.is_available():
        assert "no CUDA device" in reason


@pytest.mark.parametrize("machine, expected", [
    (dict(), r"^kvikio 26\.10\.0, cuFile 1\.15$"),
    (dict(compat=True), r"kvikio 26\.10\.0 runs in compatibility mode .*/run/udev"),
    (dict(gds=False), r"cuFile driver reports no GPUDirect Storage \(the nvidia-fs kernel module"),
    (dict(broken=RuntimeError("libcufile.so.0: cannot open")), r"cannot tell its compatibility mode "
                                                                r"\(RuntimeError: libcufile\.so\.0"),
])
def test_gds_status_tells_each_reason_kvikio_gives(fresh_gds, monkeypatch, machine, expected):
    """With kvikio and a GPU, gds_status tells GDS (with kvikio's and cuFile's versions) from compatibility
    mode, a driver without nvidia-fs, and a kvikio that fails: available only in the first case."""
    _fake_kvikio(monkeypatch, **machine)
    ok, reason = fresh_gds.gds_status()
    assert ok is (not machine)
    assert re.search(expected, reason), reason


@pytest.mark.parametrize("api", ["get", "properties", "class", "top"])
@pytest.mark.parametrize("gds", [True, False])
def test_gds_status_reads_the_driver_through_every_kvikio_release_s_interface(fresh_gds, monkeypatch, api, gds):
    """kvikio gave the cuFile driver's properties four ways over its releases (cufile_driver.get, .properties,
    .DriverProperties, and kvikio.DriverProperties before cufile_driver existed): each is read, so GDS is
    reported available or not as the driver says, never "unavailable" because of an interface change."""
    _fake_kvikio(monkeypatch, api=api, gds=gds)
    ok, reason = fresh_gds.gds_status()
    assert ok is gds
    assert reason == "kvikio 26.10.0, cuFile 1.15" if gds else "reports no GPUDirect Storage" in reason


def test_gds_status_without_a_gpu_or_with_a_kvikio_that_cannot_load(fresh_gds, monkeypatch):
    """kvikio installed but no CUDA device, or a kvikio whose import fails: unavailable, saying which."""
    import sys

    import torch

    _fake_kvikio(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fresh_gds.gds_status() == (False, "torch sees no CUDA device")
    fresh_gds.gds_status.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", None)  # import raises ImportError
    ok, reason = fresh_gds.gds_status()
    assert not ok and reason.startswith("kvikio cannot be imported (ModuleNotFoundError") or \
        reason.startswith("kvikio cannot be imported (ImportError"), reason


@pytest.mark.parametrize("available", [False, True])
def test_building_with_use_gds_warns_once_what_it_gets(fresh_gds, monkeypatch, nvme, closing, available):
    """load_config alone says nothing; the first optimizer or parameter store built with use_gds true warns
    once (a RuntimeWarning naming the caller's line) with the reason GDS is unavailable, or that state still
    moves through the pinned pool where it is available; later ones are silent."""
    import warnings

    import torch

    from offload import OffloadedAdamW, offload_parameters

    monkeypatch.setattr(fresh_gds, "gds_status", lambda: (available, "REASON"))
    model = closing(torch.nn.Linear(64, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config({"aio": {"use_gds": True}})
        assert not caught
        closing(OffloadedAdamW(model.parameters(), config=cfg, nvme_path=nvme, small_param_threshold=1))
        offload_parameters(model, config=cfg, nvme_path=nvme)
        closing(OffloadedAdamW(torch.nn.Linear(8, 8).parameters(), config=cfg, nvme_path=nvme))
    gds_warnings = [w for w in caught if "use_gds" in str(w.message)]
    assert len(gds_warnings) == 1, [str(w.message) for w in caught]
    w = gds_warnings[0]
    assert w.category is RuntimeWarning and w.filename == __file__
    text = str(w.message)
    assert "REASON" in text and "pinned host pool" in text and "Set use_gds to false to silence this" in text
    assert ("is available" in text) is available and ("not available here: REASON." in text) is (not available)


def test_the_seeds_70b_deepspeed_config_trains_a_bf16_model_like_torch(nvme, closing, tmp_path):
    """configs/ds_config_70b.json (ZeRO-3, optimizer and weights on NVMe, pinned buffers, use_gds true, bf16)
    drives offload_parameters and OffloadedAdamW as written, with only the paths given as keywords: it warns
    once about GDS here, and three steps of a bf16 model equal torch's fused AdamW on fp32 masters, rounded.
    The DeepSpeed engine's own keys (gradient_clipping, optimizer, scheduler, ...) are not ours and change
    nothing."""
    import copy
    import warnings

    import torch
    from helpers import Net, assert_same, loss_of

    from offload import OffloadedAdamW, offload_parameters
    from offload.aio import gds

    path = REPO / "configs" / "ds_config_70b.json"
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(gds, "_warned", False)
    torch.manual_seed(0)
    ref = Net().to(torch.bfloat16)
    model = closing(copy.deepcopy(ref))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            offload_parameters(model, config=path, nvme_path=str(tmp_path / "params"))
            opt = closing(OffloadedAdamW(model.parameters(), lr=1e-3, config=path, nvme_path=nvme))
        gds_warnings = [w for w in caught if "use_gds" in str(w.message)]
        assert len(gds_warnings) == 1, [str(w.message) for w in caught]
        assert opt.config.offload_optimizer.pin_memory is True and opt.config.aio.queue_depth == 8
        masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
        ref_opt = torch.optim.AdamW(masters, lr=1e-3, fused=True)
        for step in range(3):
            loss_of(model, step, torch.bfloat16).backward()
            opt.step()
            opt.zero_grad()
            loss_of(ref, step, torch.bfloat16).backward()
            for p, q in zip(ref.parameters(), masters):
                q.grad = p.grad.float()
            ref_opt.step()
            ref.zero_grad()
            with torch.no_grad():
                for p, q in zip(ref.parameters(), masters):
                    p.copy_(q)
        from offload.params import materialized

        with materialized(model):
            assert_same(list(model.parameters()), list(ref.parameters()))
    finally:
        monkeypatch.undo()


# -- one declaration per key ----------------------------------------------------------------------------------


def test_the_readme_table_of_keys_is_the_declarations():
    """The README's table of keys is what the declarations write (python -m offload.config), row for row."""
    from offload.config.blocks import keys_table

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    found = re.search(r"<!-- config keys: begin -->\n(.*?)<!-- config keys: end -->", readme, re.S)
    assert found, "the README has lost its markers around the table of keys"
    assert found.group(1) == keys_table(), "the README table is stale: paste `python -m offload.config` into it"


def test_every_key_of_a_block_is_a_keyword_of_what_uses_it():
    """OffloadedAdam takes every offload_optimizer key as a keyword, offload_parameters the offload_param keys a
    user tunes per model; each keyword is a key (nothing declared twice with different names)."""
    import inspect

    from offload import OffloadedAdam, offload_parameters

    def keywords(fn, skip):
        return {n for n, p in inspect.signature(fn).parameters.items() if n not in skip and p.default is not p.empty}

    adam = keywords(OffloadedAdam.__init__, {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
                                             "capturable", "differentiable", "fused", "config", "max_grad_norm",
                                             "seed"})
    assert adam == {f.name for f in dataclasses.fields(OptimizerOffloadConfig)}
    per_model = {"config", "prefetch", "keep_for_backward", "offload_grads", "device", "init"}
    params = keywords(offload_parameters, per_model)
    assert params <= {f.name for f in dataclasses.fields(ParamOffloadConfig)}


def test_deepspeed_keys_that_do_nothing_are_accepted_checked_and_dropped():
    """fast_init and ratio load from a DeepSpeed file without becoming settings; a bad value is still an error,
    and ratio other than 1.0 is refused (all state is offloaded)."""
    c = load_config({"zero_optimization": {"offload_optimizer": {"fast_init": True, "ratio": 1.0, "buffer_count": 6}}})
    assert c.offload_optimizer.buffer_count == 6 and not hasattr(c.offload_optimizer, "fast_init")
    assert "fast_init" not in config_to_dict(c, only=None)["offload_optimizer"]
    with pytest.raises(ConfigError, match="fast_init: must be true or false"):
        load_config({"offload_optimizer": {"fast_init": "yes"}})
    with pytest.raises(ConfigError, match="ratio: only 1.0 is supported"):
        load_config({"offload_optimizer": {"ratio": 0.5}})
    with pytest.raises(ConfigError, match='"offload_optimizer"; did you mean "fast_init"'):
        load_config({"offload_optimizer": {"fast_inits": True}})


# The ZeRO-Infinity examples of DeepSpeed's documentation, as published: docs/_tutorials/zero.md ("Offloading to
# CPU and NVMe with ZeRO-Infinity") and docs/code-docs/source/zero3.rst (NVMe; its "..." left out, and its missing
# comma kept: DeepSpeed reads it with hjson, so here it loads as a .hjson file).
ZERO_INFINITY_TUTORIAL = """{
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": true,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {
            "device": "cpu"
         },
        "offload_param": {
            "device": "cpu"
       }
   }
}"""
ZERO3_NVME = """{
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/nvme_data"
        }
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/nvme_data"
        }
    },
}"""


def test_the_zero_infinity_examples_of_deepspeed_s_docs_load(tmp_path):
    """DeepSpeed's published ZeRO-Infinity configs load: the tutorial's (JSON, state and weights in CPU memory) and
    the ZeRO-3 page's NVMe one (hjson: its missing comma is an error with its place in a .json file)."""
    c = load_config(_write(tmp_path, ZERO_INFINITY_TUTORIAL, "zero_infinity.json"))
    assert (c.offload_optimizer.device, c.offload_param.device) == ("cpu", "cpu")
    c = load_config(_write(tmp_path, ZERO3_NVME, "zero3_nvme.hjson"))
    assert c.offload_optimizer.nvme_path == c.offload_param.nvme_path == "/nvme_data"
    assert c.offload_optimizer.device == c.offload_param.device == "nvme"
    with pytest.raises(ConfigError, match=r"line 8, column 9: Expecting ',' delimiter .*\*\.hjson"):
        load_config(_write(tmp_path, ZERO3_NVME, "zero3_nvme.json"))
