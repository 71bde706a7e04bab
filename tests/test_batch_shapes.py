"""What the loop needs of the data and the model, said when it is not there: a batch is
(inputs, targets, ...), the model's outputs are logits (or a tuple whose first item they
are, for the evaluation), and anything else is one error that says what came and what
to change, not a KeyError or an AttributeError from inside the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from helpers import tiny_model, train
from slipstream import ConfigError


class DictSamples(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": torch.rand(3, 16, 16), "label": torch.tensor(i % 4)}


class Outputs(torch.nn.Module):
    """The tiny model, its logits returned as a tuple (with a second head) or a dict."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.body, self.kind = tiny_model(), kind

    def forward(self, x: torch.Tensor):
        logits = self.body(x)
        return (logits, logits.detach() * 0) if self.kind == "tuple" else {"logits": logits}


def test_a_dict_batch_without_the_documented_keys_says_so_and_what_to_change(tmp_path):
    # {"image", "label"} is taken apart as (inputs, targets) (tests/test_multilabel.py);
    # other names are not guessed.
    data = DataLoader(DictSamples(), batch_size=8, collate_fn=lambda s: {"img": torch.stack([d["image"] for d in s])})
    expected = r"tuple or list \(inputs, targets.*a dict with inputs under one of image/.*with keys \['img'\]"
    with pytest.raises(ConfigError, match=expected):
        train(tmp_path, train_data=data, max_duration="1ba", eval_interval=None)


def test_a_model_returning_a_tuple_meets_the_default_loss_with_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"returned a tuple of 2, and the loss .* needs its logits"):
        train(tmp_path, model=Outputs("tuple"), max_duration="1ba", eval_interval=None)


def test_a_tuple_with_its_own_loss_trains_and_is_evaluated_on_its_first_item(tmp_path):
    trainer = train(
        tmp_path, model=Outputs("tuple"), max_duration="2ba", loss_fn=lambda out, y: F.cross_entropy(out[0], y)
    )
    assert 0.0 <= trainer.state.eval_metrics["accuracy"] <= 1.0


def test_a_model_returning_a_dict_is_a_clear_error_at_the_evaluation(tmp_path):
    with pytest.raises(ConfigError, match=r"returned a dict with keys \['logits'\], and the evaluation needs"):
        train(tmp_path, model=Outputs("dict"), max_duration="1ba", loss_fn=lambda o, y: F.cross_entropy(o["logits"], y))
