"""pytest configuration only: thread count and hypothesis profiles.  Shared test helpers live in helpers.py."""

import os

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)  # tests run in parallel workers; tiny models gain nothing from threads

settings.register_profile(
    "seco",
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# "explore": random examples, to probe tolerances over many --hypothesis-seed values once
settings.register_profile("explore", parent=settings.get_profile("seco"), derandomize=False, max_examples=400)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seco"))
