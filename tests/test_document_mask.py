"""``data.document_mask``: attention stays within each document of a window (documents end at the
separator, token 0), so each document's logits are those of the document trained alone."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import Metrics, assert_same_training, train_run
from dtlab.config import load_config
from dtlab.errors import ConfigError
from dtlab.models import build_model
from dtlab.models.sequence import document_mask


def test_the_mask_keeps_each_token_to_its_own_document_and_its_past() -> None:
    tokens = torch.tensor([[5, 6, 0, 7, 8, 0, 9]])
    mask = document_mask(tokens, 0)[0, 0].int()
    # The separator ends (and belongs to) the document before it.
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 1],
    ]


def test_each_documents_logits_are_those_of_the_document_alone() -> None:
    config = load_config(overrides=["model.preset=debug"])
    model = build_model(config.model)
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.init_buffers()
    model.eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 256, (1, n), generator=g) for n in (7, 9, 5)]
    sep = torch.zeros(1, 1, dtype=torch.long)
    packed = torch.cat([docs[0], sep, docs[1], sep, docs[2]], dim=1)
    with torch.no_grad():
        model.document_separator = 0
        masked = model(packed)
        model.document_separator = None
        whole = model(packed)  # the mask of the forward before is not kept
        alone = [model(torch.cat([docs[0], sep], 1)), model(torch.cat([docs[1], sep], 1))]
        alone.append(model(docs[2]))
    spans = [(0, 8), (8, 18), (18, 23)]
    for (a, b), ref in zip(spans, alone, strict=True):
        torch.testing.assert_close(masked[:, a:b], ref, rtol=1e-5, atol=1e-5)
    # Without the mask the later documents see the earlier ones.
    assert (whole[:, 8:18] - alone[1]).abs().max() > 1e-2


def test_training_with_document_masks_is_the_same_on_two_processes(
    tmp_path: Path, single_reference: Any
) -> None:
    masked = ("data.document_mask=true",)
    reference: Metrics = single_reference(*masked)
    plain: Metrics = single_reference()
    assert reference != plain  # the synthetic data has separators: the mask changes the training
    run = train_run(tmp_path / "ddp", "parallel.strategy=ddp", *masked, nproc=2)
    assert_same_training(run, reference)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.strategy=ddp", "parallel.pp=2"], "parallel.pp = 2 is not supported with data"),
        (["train.engine=mlx"], "train.engine = 'mlx' is not supported with data"),
    ],
)
def test_what_document_masks_do_not_compose_with_yet_is_refused(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=["model.preset=debug", "data.document_mask=true", *overrides])
    # Context parallelism composes with it (tests/test_cp_document_mask.py).
    load_config(
        overrides=["model.preset=debug", "data.document_mask=true", "parallel.strategy=ddp",
                   "parallel.cp=2"]
    )  # fmt: skip


def test_the_mask_is_kept_once_not_once_per_layer() -> None:
    # Given the boolean mask, torch's attention would convert it into a new float tensor at each
    # call, and every layer's backward would keep its own: the model hands each layer the same
    # additive mask instead. What forward leaves for backward grows by the boolean mask and one
    # float32 copy of it (B x T^2 x 5 bytes), whatever the layers.
    from dtlab.bench.cp_memory import _held_bytes

    b, t, layers = 2, 512, 4
    config = load_config(
        overrides=["model.preset=debug", f"model.n_layers={layers}", f"model.max_seq_len={t}"]
    )
    torch.manual_seed(0)
    model = build_model(config.model, "cpu")
    tokens = torch.randint(1, config.model.vocab_size, (b, t))
    tokens[:, ::50] = 0
    kept: dict[bool, list[torch.Tensor]] = {}

    def forward(masked: bool) -> Any:
        def step() -> None:
            model.document_separator = 0 if masked else None
            kept[masked] = [model(tokens)]  # alive with its graph at the step's end

        return step

    plain, masked = (_held_bytes(forward(m)) for m in (False, True))
    grown = masked - plain
    assert b * t * t * 5 <= grown < b * t * t * 6, grown  # a per-layer copy would be 4 x 4 more
