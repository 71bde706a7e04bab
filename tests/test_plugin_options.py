"""The helpers plugins share: a duration config key parsed with an error that names
the algorithm and the key, and one random stream per training batch and rank."""

from __future__ import annotations

import pytest
import torch
from slipstream_ema import EMAConfig
from slipstream_image_size_curriculum import ImageSizeCurriculumConfig
from slipstream_stepwise_lr import StepwiseLRConfig

from slipstream import ConfigError, Duration, State, batch_generator, batch_seed, parse_duration_option


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: StepwiseLRConfig(warmup="5 weeks"), "algorithms.stepwise_lr: warmup: '5 weeks' is not a duration"),
        (lambda: StepwiseLRConfig(step_size="0ba"), "algorithms.stepwise_lr: step_size must be a positive duration"),
        (lambda: EMAConfig(start="soon"), "algorithms.ema: start: 'soon' is not a duration"),
        (
            lambda: EMAConfig(half_life="10m"),
            "algorithms.ema: half_life must be a positive duration in ba, ep, sp or dur",
        ),
        (
            lambda: ImageSizeCurriculumConfig(every="0ep"),
            "algorithms.image_size_curriculum: every must be a positive duration, got '0ep'",
        ),
    ],
)
def test_a_bad_duration_key_names_the_algorithm_and_key_even_from_python(build, message):
    # Built in Python, not through the CLI's build_config that used to add the name.
    with pytest.raises(ConfigError) as info:
        build()
    assert str(info.value).startswith(message)


def test_parse_duration_option_accepts_what_it_is_asked_to():
    assert parse_duration_option("x", "k", "0.5ep", positive=True, units=("ep",)) == Duration(0.5, "ep")
    assert parse_duration_option("x", "k", "0dur") == Duration(0.0, "dur")  # zero allowed unless positive
    with pytest.raises(ConfigError, match=r"^algorithms.x: k must be a duration in ep, got '2ba'$"):
        parse_duration_option("x", "k", "2ba", units=("ep",))


def _state(seed: int, rank: int, batch: int) -> State:
    state = State(model=torch.nn.Linear(1, 1), optimizer=None, max_duration=Duration(1, "ep"), seed=seed, rank=rank)
    state.timestamp.batch = batch
    return state


def test_one_random_stream_per_batch_and_rank():
    draw = [torch.rand(4, generator=batch_generator(_state(0, 0, b))) for b in (3, 3, 4)]
    assert torch.equal(draw[0], draw[1]) and not torch.equal(draw[0], draw[2])
    other_rank = torch.rand(4, generator=batch_generator(_state(0, 1, 3)))
    other_seed = torch.rand(4, generator=batch_generator(_state(1, 0, 3)))
    assert not torch.equal(draw[0], other_rank) and not torch.equal(draw[0], other_seed)
    # The stream depends on the three numbers alone: the global generator neither
    # feeds it nor moves.
    before = torch.get_rng_state()
    torch.manual_seed(123)
    again = torch.rand(4, generator=batch_generator(_state(0, 0, 3)))
    torch.set_rng_state(before)
    assert torch.equal(again, draw[0])
    assert batch_seed(0, 0, 3) == batch_generator(_state(0, 0, 3)).initial_seed()
