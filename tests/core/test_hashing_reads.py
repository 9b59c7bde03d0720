"""Hashing a checkpoint file with the reads that use it ([Note: hashing while reading]): the
digest is hashlib's over the whole file whatever the reads were, and reads in the file's order
read each byte once."""

import hashlib
import os

import pytest
from tierwise.checkpoint.hashing_reads import SKIP_BLOCK_BYTES, HashingReads


@pytest.fixture
def file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(2 * SKIP_BLOCK_BYTES + 12_345))  # gaps span several blocks
    return path


def _read(reads: HashingReads, offset: int, nbytes: int) -> bytes:
    view = memoryview(bytearray(nbytes))
    reads.read_into(view, offset)
    return bytes(view)


@pytest.mark.parametrize(
    "ranges",
    [
        [],  # nothing read: digest reads it all
        [(0, 100), (100, 5000)],  # in order, adjacent
        [
            (17, 3),
            (SKIP_BLOCK_BYTES + 5, 70_000),
            (2 * SKIP_BLOCK_BYTES, 12_345),
        ],  # gaps, to the end
        [(1000, 50), (10, 20), (900, 200), (5000, 1)],  # behind, straddling the cursor
        [(0, 0), (123, 0)],  # empty reads
    ],
)
def test_the_digest_is_hashlib_over_the_file_and_reads_give_its_bytes(file, ranges):
    data = file.read_bytes()
    reads = HashingReads(file)
    try:
        for offset, nbytes in ranges:
            assert _read(reads, offset, nbytes) == data[offset : offset + nbytes]
        assert reads.digest() == hashlib.sha256(data).hexdigest()
        assert reads.bytes_read == len(data) + reads.reread_bytes
    finally:
        reads.close()


def test_reads_in_file_order_read_each_byte_once(file):
    size = file.stat().st_size
    reads = HashingReads(file)
    try:
        at = 0
        while at < size:  # a used range, then a skipped one (the moments)
            _read(reads, at, min(1000, size - at))
            at += 3000
        reads.digest()
        assert (reads.bytes_read, reads.reread_bytes) == (size, 0)
    finally:
        reads.close()


def test_a_read_past_the_end_is_an_error(file):
    reads = HashingReads(file)
    try:
        with pytest.raises(EOFError, match="ends at byte"):
            _read(reads, file.stat().st_size - 10, 20)
    finally:
        reads.close()
