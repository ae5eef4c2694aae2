"""LitData's Parquet reader, packed: a module of its own, imported by the LitData configurations
only (its spawned workers import it again to unpickle the dataset)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.utils.data

from benchmarks.parquet_prose import SEQ, encode


class LitPacked(torch.utils.data.IterableDataset[Any]):
    """LitData's ``StreamingDataset`` over the Parquet files (its ``ParquetLoader``, shuffled,
    split between the workers by LitData), its rows tokenized 64 at a time and cut into
    ``SEQ``-token sequences in the worker (the rest of each cut carried to the next)."""

    def __init__(self, folder: str, tokenizer: str) -> None:
        self.folder, self.tokenizer = folder, tokenizer

    def __iter__(self) -> Iterator[Any]:
        import litdata as ld
        from litdata.streaming.item_loader import ParquetLoader

        rows: list[str] = []
        carry = np.zeros(0, dtype=np.int64)
        for row in ld.StreamingDataset(self.folder, item_loader=ParquetLoader(), shuffle=True):
            rows.append(row["text"])
            if len(rows) < 64:
                continue
            arrays = [np.asarray(x, np.int64) for x in encode(rows, self.tokenizer)]
            flat = np.concatenate([carry, *arrays])
            rows = []
            whole = len(flat) // SEQ * SEQ
            yield from flat[:whole].reshape(-1, SEQ)
            carry = flat[whole:]
