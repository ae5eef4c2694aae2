"""A Parquet file's footer as a tree of Thrift fields, edited and written back: how the tests
make files whose footer says what their pages do not (a writer's bug, an edited file)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

# Thrift compact protocol types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        out, shift = 0, 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return out

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int) -> Any:
        if kind in (_TRUE, _FALSE):
            return kind == _TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            self.pos += 8
            return struct.unpack("<d", self.data[self.pos - 8 : self.pos])[0]
        if kind == _BINARY:
            n = self.varint()
            self.pos += n
            return self.data[self.pos - n : self.pos]
        if kind in (_LIST, _SET):
            head = self.byte()
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            if elem in (_TRUE, _FALSE):
                return (elem, [self.byte() == 1 for _ in range(size)])
            return (elem, [self.value(elem) for _ in range(size)])
        if kind == _STRUCT:
            return self.struct()
        raise ValueError(f"thrift type {kind} is not read here")

    def struct(self) -> list[list[Any]]:
        fields, last = [], 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            delta, kind = head >> 4, head & 0x0F
            fid = last + delta if delta else self.zigzag()
            last = fid
            fields.append([fid, kind, self.value(kind)])


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray()

    def varint(self, n: int) -> None:
        while True:
            if n < 0x80:
                self.out.append(n)
                return
            self.out.append((n & 0x7F) | 0x80)
            n >>= 7

    def zigzag(self, n: int) -> None:
        self.varint((n << 1) ^ (n >> 63))

    def value(self, kind: int, v: Any) -> None:
        if kind in (_TRUE, _FALSE):
            return
        if kind == _BYTE:
            self.out.append(v)
        elif kind in (_I16, _I32, _I64):
            self.zigzag(v)
        elif kind == _DOUBLE:
            self.out += struct.pack("<d", v)
        elif kind == _BINARY:
            self.varint(len(v))
            self.out += v
        elif kind in (_LIST, _SET):
            elem, items = v
            if len(items) < 15:
                self.out.append(len(items) << 4 | elem)
            else:
                self.out.append(0xF0 | elem)
                self.varint(len(items))
            for item in items:
                if elem in (_TRUE, _FALSE):
                    self.out.append(1 if item else 2)
                else:
                    self.value(elem, item)
        elif kind == _STRUCT:
            self.struct(v)

    def struct(self, fields: list[list[Any]]) -> None:
        last = 0
        for fid, kind, v in fields:
            if kind in (_TRUE, _FALSE):
                kind = _TRUE if v else _FALSE
            if 0 < fid - last <= 15:
                self.out.append((fid - last) << 4 | kind)
            else:
                self.out.append(kind)
                self.zigzag(fid)
            last = fid
            self.value(kind, v)
        self.out.append(0)


def field(fields: list[list[Any]], fid: int) -> list[Any]:
    """The field numbered ``fid`` of a struct (``[id, type, value]``, edited in place)."""
    return next(f for f in fields if f[0] == fid)


def read_footer(path: Path) -> tuple[bytes, list[list[Any]]]:
    """The bytes before the footer and the footer's FileMetaData fields."""
    data = path.read_bytes()
    n = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - n
    return data[:start], _Reader(data[start : len(data) - 8]).struct()


def write_footer(path: Path, body: bytes, meta: list[list[Any]]) -> None:
    w = _Writer()
    w.struct(meta)
    path.write_bytes(body + bytes(w.out) + len(w.out).to_bytes(4, "little") + b"PAR1")


def set_num_rows(path: Path, group: int, rows: int) -> None:
    """Make ``path``'s footer say that row group ``group`` holds ``rows`` rows (and the file as
    many fewer rows in all), its pages unchanged."""
    body, meta = read_footer(path)
    groups = field(meta, 4)[2][1]  # FileMetaData.row_groups
    num = field(groups[group], 3)  # RowGroup.num_rows
    total = field(meta, 3)  # FileMetaData.num_rows
    total[2] -= num[2] - rows
    num[2] = rows
    write_footer(path, body, meta)
