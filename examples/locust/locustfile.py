"""Locust load for the regression gate: steady inference requests at a target rate.

    locust -f examples/locust/locustfile.py --headless --users 10 --spawn-rate 10 --run-time 2m --stop-timeout 10 \
        --host http://candidate:8080

Each simulated user sends ``RATE_PER_USER`` requests per second (environment
variable, default 10), so the target rate is users x RATE_PER_USER. The
service's spans, not Locust's own timings, are what ``spikehound compare``
judges: Locust only has to produce steady, realistic traffic.
"""

from __future__ import annotations

import os
import random

from locust import HttpUser, constant_throughput, task

RATE_PER_USER = float(os.environ.get("RATE_PER_USER", "10"))


class InferenceUser(HttpUser):
    wait_time = constant_throughput(RATE_PER_USER)

    @task
    def predict(self) -> None:
        self.client.post("/v1/predict", json={"user_id": random.randrange(2000)}, name="POST /v1/predict")
