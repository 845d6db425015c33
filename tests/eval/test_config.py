"""Drafter specs (``NAME[:KEY=VALUE,...]``), the configuration and its key (``eval.config``)."""

from __future__ import annotations

import dataclasses

import pytest

from eval import config as C
from eval.config import DrafterSpec, EvalConfig


def test_parse_drafter_specs():
    assert C.parse_drafter_spec("lookup") == DrafterSpec("lookup")
    medusa = C.parse_drafter_spec("medusa:heads=/tmp/m")
    assert (medusa.name, medusa.options, medusa.key) == ("medusa", (("heads", "/tmp/m"),), "medusa:heads=/tmp/m")
    model = C.parse_drafter_spec("model:draft=qwen2.5-coder-0.5b,topk=8,depth=4")
    assert model.draft == "qwen2.5-coder-0.5b" and model.factory_options() == {"topk": 8, "depth": 4}
    assert model.key == "model:depth=4,draft=qwen2.5-coder-0.5b,topk=8"  # options sorted: one key per drafter
    assert C.parse_drafter_spec("model:topk=8,depth=4").key == C.parse_drafter_spec("model:depth=4,topk=8").key
    # JSON values; commas inside brackets / quotes do not split
    spec = C.parse_drafter_spec('medusa:heads=/h,choices=[[0],[0,1]],tag="a,b"')
    assert dict(spec.options) == {"heads": "/h", "choices": [[0], [0, 1]], "tag": "a,b"}
    # module:function factories, with and without options; a label
    assert C.parse_drafter_spec("tests.eval.tiny:make_drafter").name == "tests.eval.tiny:make_drafter"
    fac = C.parse_drafter_spec("tiny=tests.eval.tiny:make_drafter:width=2")
    assert (fac.label, fac.name, fac.options) == ("tiny", "tests.eval.tiny:make_drafter", (("width", 2),))
    assert C.parse_drafter_spec("m8=model:topk=8").label == "m8"
    # merged drafters: names joined by '+', PART.KEY options
    merged = C.parse_drafter_spec("both=lookup+eagle:heads=/h,lookup.max_depth=12,draft_vocab=4096")
    assert (merged.label, merged.name) == ("both", "lookup+eagle")
    assert merged.factory_options() == {"heads": "/h", "lookup.max_depth": 12, "draft_vocab": 4096}
    assert merged.key == "lookup+eagle:draft_vocab=4096,heads=/h,lookup.max_depth=12"
    # compile=true: an engine option, kept out of the factory's options
    comp = C.parse_drafter_spec("eagle:heads=/h,compile=true")
    assert comp.compile and comp.factory_options() == {"heads": "/h"} and not C.parse_drafter_spec("lookup").compile
    # drafter_options: compile goes to a drafter whose constructor takes it (the draft model), not to the others
    mc = C.parse_drafter_spec("model:draft=qwen2.5-coder-0.5b,depth=4,compile=true")
    assert mc.drafter_options() == {"depth": 4, "compile": True}
    assert C.parse_drafter_spec("lookup:compile=true").drafter_options() == {}
    assert C.parse_drafter_spec("model:depth=4").drafter_options() == {"depth": 4}
    # compile=layers: the draft model's layers compiled as the engine's (the engine's compile is layer-wise anyway)
    ml = C.parse_drafter_spec("model:compile=layers")
    assert ml.compile == "layers" and ml.drafter_options() == {"compile": "layers"}


@pytest.mark.parametrize("text, match", [
    ("nope", "--drafters: unknown drafter 'nope'; expected one of model, medusa, lookup, eagle \\(or several joined "
             "by '\\+': a merged tree\\) or module:function"),
    ("lookup:compile=yes", "--drafters: expected compile=true, compile=false, compile=layers or compile=max-autotune, "
                           "got 'yes'"),
    ("lookup+nope", "--drafters: unknown drafter 'lookup\\+nope'"),
    ("lookup+eagle:a.b.c=1", "--drafters: malformed option .a.b.c=1."),
    ("model:depth", "--drafters: malformed option 'depth' in 'model:depth'; expected KEY=VALUE"),
    ("model:depth=4,topk", "--drafters: malformed option 'topk' in 'model:depth=4,topk'"),
    ("model:=4", "--drafters: malformed option '=4'"),
    ("model:depth=1,depth=2", "--drafters: option given twice"),
    ("", "--drafters: expected a drafter spec"),
    ("x=", "--drafters: expected LABEL=NAME"),
    (":f", "--drafters: expected NAME or module:function"),
])  # fmt: skip
def test_bad_drafter_specs_name_the_argument(text, match):
    with pytest.raises(ValueError, match=match):
        C.parse_drafter_spec(text)


def test_config_drafters_labels_and_key(tmp_path):
    cfg = EvalConfig(drafters=("lookup", "model:depth=3", "model:depth=5", "big=model:draft=x"), out=str(tmp_path / "r"))
    assert all(isinstance(s, DrafterSpec) for s in cfg.drafters)
    assert list(cfg.labels().values()) == ["lookup", "model:depth=3", "model:depth=5", "big"]
    assert [d["label"] for d in cfg.describe()["drafters"]] == ["lookup", "model:depth=3", "model:depth=5", "big"]
    # drafters are not in the key: baselines are shared when drafters are added
    assert C.config_key(cfg) == C.config_key(EvalConfig(drafters=("medusa:heads=/h",), out=str(tmp_path / "r")))
    assert EvalConfig(drafters="lookup").drafters == (DrafterSpec("lookup"),)
    with pytest.raises(ValueError, match="drafters: the same drafter given twice: model:depth=3"):
        EvalConfig(drafters=("model:depth=3", "model:depth=3"))
    with pytest.raises(ValueError, match="drafters: two drafters labelled 'a'"):
        EvalConfig(drafters=("a=lookup", "a=model"))
    with pytest.raises(ValueError, match="drafters: unknown drafter 'nope'"):
        EvalConfig(drafters=("nope",))


def test_samples_validation_and_key(tmp_path):
    out = str(tmp_path / "r.jsonl")
    cfg = EvalConfig(dataset="humaneval", target="t", draft=None, temperature=0.8, dtype="fp32", device="cpu", out=out)
    assert cfg.samples == 1
    # one sample: the key of runs made before --samples existed (result files stay resumable)
    assert C.config_key(cfg) == "4a01d68de074"
    four = EvalConfig(dataset="humaneval", target="t", draft=None, temperature=0.8, dtype="fp32", device="cpu",
                      out=out, samples=4)  # fmt: skip
    assert C.config_key(four) != C.config_key(cfg) and four.describe()["samples"] == 4
    with pytest.raises(ValueError, match="samples: expected an int >= 1, got 0"):
        EvalConfig(samples=0, temperature=0.8)
    with pytest.raises(ValueError, match="samples: expected an int >= 1, got 2.0"):
        EvalConfig(samples=2.0, temperature=0.8)
    with pytest.raises(ValueError, match="samples: 4 samples per problem need temperature > 0 .*got temperature 0"):
        EvalConfig(samples=4)
    # the copy layout (--no-shared-prompt): a key of its own; the shared default keeps the old key
    copy = dataclasses.replace(four, shared_prompt=False)
    assert len({C.config_key(copy), C.config_key(four), C.config_key(cfg)}) == 3
    # the compiled prefill (--compile-prefill) likewise: a key of its own, the default keeps the old one
    assert C.config_key(dataclasses.replace(cfg, compile_prefill=True)) != C.config_key(cfg) == "4a01d68de074"
    assert C.config_key(dataclasses.replace(four, shared_prompt=True)) == C.config_key(four)
    with pytest.raises(ValueError, match=r"shared_prompt: expected a bool, got 'no'"):
        dataclasses.replace(four, shared_prompt="no")


def test_no_shared_prompt_flag_needs_samples(capsys):
    from specdec import cli

    assert cli.main(["sweep", "--dataset", "humaneval", "--no-shared-prompt", "--device", "cpu", "--no-progress"]) == 2
    assert "--no-shared-prompt: False (the copy layout) only with samples > 1, got samples 1" in capsys.readouterr().err
