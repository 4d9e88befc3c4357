"""The Prometheus endpoint of the real embd (metrics_listen, daemon/metrics.h): scraped while two
trainers train, parsed by prometheus_client's own text parser, and checked against
`embctl stats --json` and `embctl status --json` once the training stopped; other paths and
methods refused; a port that cannot be bound stops the start, naming the key."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

import embd
from support import EMBCTL, EMBD, Service, TableSpec, ThreadTrainer, free_port, make_batch, \
    make_grad, run

B = 8
TABLES = [
    TableSpec("t_sum", 200, 8, "sum", ("f_a", "f_b"), {"type": "sgd", "lr": 0.1}),
    TableSpec("t_mean", 50, 4, "mean", ("f_c",), {"type": "sgd", "lr": 0.1}),
]
TOTAL_DIM = 20

Samples = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


def scrape(port: int) -> Tuple[Samples, Dict[str, str]]:
    """Every sample of GET /metrics by (name, sorted labels), and each family's type."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    samples: Samples = {}
    types: Dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def embctl_json(service: Service, what: str) -> dict:
    return json.loads(run([str(EMBCTL), what, "--socket", service.socket, "--json"]))


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Tuple[Service, int]]:
    port = free_port()
    svc = Service(tmp_path, TABLES, B, trainers=2,
                  extra={"metrics_listen": f"127.0.0.1:{port}"}).start()
    yield svc, port
    svc.stop()


def train(sock: str, index: int, steps: int, refuse_at: int) -> None:
    with embd.Client(sock, index=index) as c:
        for step in range(steps):
            b = c.batch(0)
            nb = make_batch(TABLES, B, step, index)
            n = b.write(nb.lengths, nb.values)
            if step == refuse_at and index == 1:
                b.values[0] = 10_000                  # outside t_sum: refused with ERANGE
                with pytest.raises(embd.OutOfRangeError):
                    c.forward(0, step, n)
                del b
                continue
            c.forward(0, step, n)
            b.grad[:] = make_grad(B, TOTAL_DIM, step, index)
            c.backward(0, step, n)
            del b


def test_scrapes_during_training_match_embctl_stats(service: Tuple[Service, int]) -> None:
    svc, port = service
    steps = 400
    trainers = [ThreadTrainer(lambda i=i: train(svc.socket, i, steps, refuse_at=5))
                for i in range(2)]
    seen: List[float] = []
    while any(t.is_alive() for t in trainers):
        samples, types = scrape(port)
        seen.append(get(samples, "embd_steps_total"))
        time.sleep(0.002)
    for t in trainers:
        t.join()
    assert seen == sorted(seen), f"embd_steps_total went back: {seen}"
    assert len(set(seen)) >= 2, f"embd_steps_total did not grow during training: {seen}"

    # the loop publishes at least every second once idle: wait for the final figures
    stats = embctl_json(svc, "stats")
    deadline = time.monotonic() + 5
    samples, types = scrape(port)
    while get(samples, "embd_steps_total") != stats["steps"] and time.monotonic() < deadline:
        time.sleep(0.1)
        samples, types = scrape(port)
    status = embctl_json(svc, "status")

    assert stats["steps"] == steps
    assert get(samples, "embd_steps_total") == stats["steps"]
    assert get(samples, "embd_aborted_steps_total") == stats["aborted_steps"]
    assert get(samples, "embd_ids_total") == stats["ids"]
    assert get(samples, "embd_requests_total") == stats["requests"]
    assert get(samples, "embd_bytes_total", link="trainer_in") == stats["bytes_in"]
    assert get(samples, "embd_bytes_total", link="trainer_out") == stats["bytes_out"]
    assert get(samples, "embd_bytes_total", link="peer_out") == stats["sent_bytes"] == 0
    assert {t["name"] for t in stats["tables"]} == {"t_sum", "t_mean"}
    for t in stats["tables"]:
        assert t["lookups"] > 0
        assert get(samples, "embd_lookups_total", table=t["name"]) == t["lookups"]
    for r in stats["ranks"]:
        assert get(samples, "embd_rank_memory_bytes", rank=str(r["rank"]),
                   numa_node=str(r["numa_node"])) == r["memory_bytes"]
    human = run([str(EMBCTL), "stats", "--socket", svc.socket])
    for t in stats["tables"]:
        assert f"table {t['name']}  lookups {t['lookups']}\n" in human, human
    assert "refused ERANGE 1\n" in human, human
    assert stats["refusals"] == {"ERANGE": 1}
    assert get(samples, "embd_refusals_total", cause="ERANGE") == 1
    assert get(samples, "embd_refusals_total", cause="EAGAIN") == 0
    assert get(samples, "embd_clients_connected") == status["clients"]
    assert get(samples, "embd_step") == status["step"]
    assert get(samples, "embd_info", version=status["version"]) == 1

    # the step histogram: cumulative buckets ending in +Inf = _count = steps
    assert types["embd_step_duration_seconds"] == "histogram"
    assert types["embd_steps"] == "counter"
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in samples.items()
                     if k[0] == "embd_step_duration_seconds_bucket")
    assert buckets[-1] == (float("inf"), steps)
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets
    assert get(samples, "embd_step_duration_seconds_count") == steps
    assert get(samples, "embd_step_duration_seconds_sum") > 0
    # checkpoint_dir is set by the fixture's config: no checkpoint was taken yet
    assert get(samples, "embd_checkpoints_total", result="ok") == 0
    assert "embd_cluster_generation" not in types


def test_checkpoint_figures_follow_embctl_checkpoint(service: Tuple[Service, int]) -> None:
    svc, port = service
    reply = json.loads(run([str(EMBCTL), "checkpoint", "--socket", svc.socket, "--wait",
                            "--timeout", "30"]))
    assert reply["ok"]
    deadline = time.monotonic() + 5
    samples, _ = scrape(port)
    while get(samples, "embd_checkpoints_total", result="ok") < 1 and \
            time.monotonic() < deadline:
        time.sleep(0.1)
        samples, _ = scrape(port)
    assert get(samples, "embd_checkpoints_total", result="ok") == 1
    assert get(samples, "embd_checkpoints_total", result="failed") == 0
    assert get(samples, "embd_checkpoint_write_duration_seconds_count") == 1
    assert get(samples, "embd_checkpoint_last_write_seconds") == pytest.approx(
        reply["write_ms"] / 1e3)
    assert get(samples, "embd_checkpoint_last_bytes") == reply["bytes"]
    assert get(samples, "embd_checkpoint_in_progress") == 0


def test_other_paths_and_methods_refused(service: Tuple[Service, int]) -> None:
    _, port = service
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
    assert e.value.code == 404
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 405 and e.value.headers["Allow"] == "GET"


def test_a_port_in_use_stops_the_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        svc = Service(tmp_path, TABLES, B, trainers=1,
                      extra={"metrics_listen": f"127.0.0.1:{port}"})
        p = subprocess.run([str(EMBD), "--config", str(svc.config_path), "--socket",
                            svc.socket], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert "metrics_listen" in p.stderr and "in use" in p.stderr, p.stderr


def test_the_grafana_dashboard_names_only_metrics_embd_serves() -> None:
    repo = Path(__file__).resolve().parents[2]
    dashboard = json.loads((repo / "tools" / "grafana-embd.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set(re.findall(r"\bembd_[a-z_]+", " ".join(exprs)))
    documented = set(re.findall(r"\bembd_[a-z_]+", (repo / "daemon" / "metrics.h").read_text()))
    # a histogram's series are its name with _bucket, _sum, _count
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert used and used <= documented, f"not served by embd: {sorted(used - documented)}"
