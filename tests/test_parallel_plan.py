"""Plans, stage cuts, model layouts and the mesh, checked in one process: the plan's
errors state the numbers, stages split blocks evenly, thinwire reads its own and Hugging
Face's models (and says what to pass for others), and the mesh groups of a 64-rank world
are laid out tensor-parallel innermost (PyTorch's fake process group: no traffic)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from thinwire.parallel import ParallelPlan, read_layout
from thinwire.parallel.mesh import (
    groups_along,
    make_mesh,
    rank_grid,
    warn_if_tensor_parallel_spans_hosts,
)
from thinwire.parallel.stages import StageModule, even_boundaries, stage_ranges
from thinwire.parallel.tensor import check_tensor_parallel
from thinwire.parallel.tied import stage_of, tied_names
from thinwire.tasks.transformer import TransformerConfig, TransformerLM

pytestmark = pytest.mark.timeout(60)


def _model(style: str = "gpt", layers: int = 4) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(style=style, vocab=64, dim=32, layers=layers, heads=4))


# -- the plan ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,message",
    [
        ({"dp": 0}, "dp must be an integer >= 1, got 0"),
        ({"tp": True}, "tp must be an integer >= 1, got True"),
        ({"microbatches": 2.0}, "microbatches must be an integer >= 1"),
        ({"schedule": "zero-bubble"}, "schedule must be one of gpipe, 1f1b, interleaved-1f1b"),
        ({"pp": 4, "stages": (2, 4)}, "3 block indices for pp=4"),
        ({"pp": 3, "stages": (4, 2), "microbatches": 3}, "increasing block indices"),
        ({"pp": 4, "microbatches": 2}, "microbatches=2 < pp=4"),
        ({"pp": 4, "microbatches": 9, "schedule": "interleaved-1f1b"}, "below pp or a multiple"),
        ({"dp_method": "zip"}, "unknown compressor 'zip'; choose one of"),
        ({"dp_method": "powersgd", "dp_options": {"rnk": 2}}, "has no option(s) rnk"),
        ({"dp_options": {"rank": 2}}, "dp_method='dense', which has none"),
    ],
)
def test_a_bad_plan_is_refused_with_its_numbers(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelPlan(**options)


def test_the_plan_must_fill_the_world() -> None:
    plan = ParallelPlan(dp=2, pp=2, tp=2, microbatches=2)
    plan.check_world(8)
    with pytest.raises(ValueError, match=r"dp \* pp \* tp = 2 \* 2 \* 2 = 8 ranks, but 6 are"):
        plan.check_world(6)
    with pytest.raises(ValueError, match="needs pp >= 2"):
        ParallelPlan(dp=4, schedule="interleaved-1f1b").check_world(4)


def test_the_batch_must_split_into_equal_microbatches() -> None:
    plan = ParallelPlan(dp=2, microbatches=4)
    plan.check_batch(16)
    with pytest.raises(ValueError, match=r"batch of 12 samples .* multiple of 8"):
        plan.check_batch(12)


def test_plans_differ_in_their_description_exactly_when_they_differ() -> None:
    a = ParallelPlan(dp=2, dp_method="powersgd", dp_options={"rank": 2})
    assert (
        a.describe() == ParallelPlan(dp=2, dp_method="powersgd", dp_options={"rank": 2}).describe()
    )
    assert (
        a.describe() != ParallelPlan(dp=2, dp_method="powersgd", dp_options={"rank": 4}).describe()
    )
    assert "dp_method=powersgd(rank=2)" in str(a)


# -- stages -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "blocks,stages,expected",
    [(16, 4, (4, 8, 12)), (10, 4, (3, 6, 8)), (4, 4, (1, 2, 3)), (5, 1, ())],
)
def test_blocks_split_as_evenly_as_they_go(blocks: int, stages: int, expected: tuple) -> None:
    boundaries = even_boundaries(blocks, stages)
    assert boundaries == expected
    sizes = [len(r) for r in stage_ranges(blocks, boundaries)]
    assert sum(sizes) == blocks and max(sizes) - min(sizes) <= 1


def test_too_few_blocks_for_the_stages_is_refused() -> None:
    with pytest.raises(ValueError, match="has 4 blocks, too few for 8 pipeline stages"):
        even_boundaries(4, 8)
    with pytest.raises(ValueError, match="inside the model's 4 blocks"):
        stage_ranges(4, (2, 4))


def test_a_stage_keeps_only_its_parts_under_the_models_names() -> None:
    model = _model(layers=4)
    layout = read_layout(model)
    first = StageModule(model, layout, range(0, 2), first=True, last=False)
    last = StageModule(model, layout, range(2, 4), first=False, last=True)
    first_names = {n.removeprefix("model.") for n, _ in first.named_parameters()}
    last_names = {n.removeprefix("model.") for n, _ in last.named_parameters()}
    assert first_names | last_names == {n for n, _ in model.named_parameters()}
    assert not first_names & last_names
    assert "embed.tokens.weight" in first_names and "head.weight" in last_names
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(last(first(tokens)), model(tokens))


# -- layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_thinwire_models_are_read(style: str) -> None:
    layout = read_layout(_model(style))
    assert layout.blocks == "blocks" and layout.heads == 4 and layout.vocab == 64
    assert ("mlp.gate" in layout.column) == (style == "llama")


def test_hugging_face_models_are_read() -> None:
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    )
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        )
    )
    assert read_layout(gpt2).blocks == "transformer.h"
    assert read_layout(llama).kv_heads == 2
    assert tied_names(gpt2) == [["transformer.wte.weight", "lm_head.weight"]]
    ranges = stage_ranges(2, (1,))
    layout = read_layout(gpt2)
    assert [stage_of(n, layout, ranges) for n in tied_names(gpt2)[0]] == [0, 1]
    with pytest.raises(ValueError, match="fuses query, key and value in one Conv1D"):
        check_tensor_parallel(layout, 2)
    with pytest.raises(ValueError, match="does not divide the model's key/value heads 2"):
        check_tensor_parallel(read_layout(llama), 4)


def test_a_model_without_readable_blocks_gets_told_what_to_pass() -> None:
    with pytest.raises(ValueError, match=r"cannot find the blocks of Sequential .* layout="):
        read_layout(nn.Sequential(nn.Linear(4, 4)))


def test_tensor_parallel_degree_must_divide_heads_and_vocabulary() -> None:
    layout = read_layout(_model())
    check_tensor_parallel(layout, 4)
    with pytest.raises(ValueError, match="tp=3 does not divide the model's attention heads 4"):
        check_tensor_parallel(layout, 3)


# -- the mesh at 64 ranks, in one process -----------------------------------------------


def test_grid_puts_tensor_parallel_innermost() -> None:
    plan = ParallelPlan(dp=4, pp=2, tp=8, microbatches=2)
    grid = rank_grid(plan)
    assert groups_along(grid, 2)[0] == list(range(8))  # tp: neighbours
    assert groups_along(grid, 1)[0] == [0, 8, 16, 24]  # dp: stride tp
    assert groups_along(grid, 0)[0] == [0, 32]  # pp: stride dp * tp


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=37, world_size=64)
    yield
    dist.destroy_process_group()


def test_the_mesh_of_64_ranks_gives_each_rank_its_rows(fake_world) -> None:
    mesh = make_mesh(ParallelPlan(dp=4, pp=2, tp=8, microbatches=2))
    # rank 37 = (pp 1 * dp 4 + dp 0) * tp 8 + tp 5
    assert dist.get_process_group_ranks(mesh["tp"].get_group()) == list(range(32, 40))
    assert dist.get_process_group_ranks(mesh["dp"].get_group()) == [37, 45, 53, 61]
    assert dist.get_process_group_ranks(mesh["pp"].get_group()) == [5, 37]
    assert (mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()) == (1, 0)


def test_a_tensor_parallel_group_across_hosts_warns_with_its_cost(
    fake_world, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.warns(UserWarning, match="tensor-parallel groups of 8 ranks span hosts of 4"):
        warn_if_tensor_parallel_spans_hosts(ParallelPlan(dp=4, pp=2, tp=8, microbatches=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_tensor_parallel_spans_hosts(ParallelPlan(dp=8, pp=2, tp=4, microbatches=2))
