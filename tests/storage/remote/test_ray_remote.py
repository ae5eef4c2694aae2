"""``prepare --engine ray`` and the Ray datasink to object storage (a real S3 server on 127.0.0.1,
a real local Ray cluster whose workers get the server's environment)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import guideloom as gl  # noqa: E402
from guideloom._cli import main  # noqa: E402
from guideloom_dev.servers import MotoS3  # noqa: E402
from tests.cli.test_prepare_tasks import samples, write_corpus  # noqa: E402
from tests.support.remote import BUCKET, unique  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
]


@pytest.fixture(scope="module")
def s3_ray(s3: MotoS3) -> Iterator[MotoS3]:
    """A local Ray cluster whose workers reach the S3 server; the driver's environment too."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3.env().items():
            mp.setenv(k, v)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": s3.env()})
        yield s3
        ray.shutdown()


@pytest.mark.slow
def test_ray_tasks_write_parts_to_s3(s3_ray: MotoS3, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(0, 600, 3))), ("txt", [4])])
    options = ["--task-size", "1024", "--document-ids", "--quiet"]
    url = f"s3://{BUCKET}/{unique('ray-tasks')}"
    assert main(["prepare", str(corpus), "--output", str(tmp_path / "one"), *options]) == 0
    assert main(["prepare", str(corpus), "--output", url, "--engine", "ray", "--tasks", "3", *options]) == 0
    assert main(["verify", url, "--quiet"]) == 0
    assert samples(url, "stream") == samples(tmp_path / "one", "stream")


@pytest.mark.slow
def test_the_datasink_writes_to_s3(s3_ray: MotoS3, tmp_path: Path) -> None:
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 1000, n).astype(np.uint16) for n in (4, 30, 0, 7, 12, 99)]
    ds = ray.data.from_items([{"tokens": d.tolist()} for d in docs], override_num_blocks=3)
    url = f"s3://{BUCKET}/{unique('ray-sink')}"
    manifest = gl.write_ray_dataset(ds, url, dtype="uint16", kind="documents")
    assert manifest.num_documents == len(docs)
    gl.write_documents(tmp_path / "want", docs)
    assert samples(url, "documents") == samples(tmp_path / "want", "documents")
    gl.verify_dataset(url)
