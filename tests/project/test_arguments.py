"""Arguments that used to mean something else without a word: refused at construction, quoting the value."""

from __future__ import annotations

import pytest

from lightning_memguard import ActivationCheckpointing, MemGuard
from lightning_memguard.commands.cli import main
from lightning_memguard.core.units import parse_bytes
from lightning_memguard.testing import SysmemSpillEmulator


@pytest.mark.parametrize("capacity", [0.5, "0.5B", "0.9", "0.5", 1e-3, "1.5B", "0.0001KB", 16e9 + 0.5])
def test_a_capacity_of_less_than_a_byte_or_a_fraction_of_one_is_refused(capacity):
    # these became int(0.5) == 0 bytes (or a truncated size), and every run then "spilled"
    with pytest.raises(ValueError, match=rf"`capacity` must be a whole number of bytes, at least 1, got {capacity!r}"):
        MemGuard(capacity=capacity)
    with pytest.raises(ValueError, match=r"`capacity` must be a whole number of bytes"):
        SysmemSpillEmulator(capacity=capacity)


@pytest.mark.parametrize(("text", "expected"), [("0.1GB", 10**8), ("1.5KiB", 1536), (".5KB", 500), (1.5e9, 15 * 10**8)])
def test_decimal_sizes_that_are_whole_bytes_are_exact(text, expected):
    assert parse_bytes(text) == expected


def test_the_command_refuses_a_fractional_emulated_capacity(tmp_path, capsys):
    code = main(["sweep", "--model", "resnet18", "--image-size", "32", "--device", "cpu", "--batch-sizes", "4",
                 "--steps", "1", "--emulate-capacity", "0.5", "--out", str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--emulate-capacity must be a whole number of bytes, at least 1, got '0.5'" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [
        (1, ValueError, r"`memory_budget` in bytes must be at least 1MB, got 1 \(a fraction: a float such as 0.6\)"),
        ("512KB", ValueError, r"`memory_budget` in bytes must be at least 1MB, got '512KB'"),
        (1.5, ValueError, r"`memory_budget` as a fraction must be in \(0, 1\], got 1.5 \(bytes: an int or '6GB'\)"),
        (0.0, ValueError, r"`memory_budget` as a fraction must be in \(0, 1\], got 0.0"),
        ("0.5", ValueError, r"`memory_budget` must be a whole number of bytes, at least 1, got '0.5'"),
        (True, TypeError, r"`memory_budget` must be a fraction in \(0, 1\] \(a float\), a size in bytes"),
        ([6], TypeError, r"`memory_budget` must be .*got \[6\]"),
    ],
)
def test_activation_checkpointing_budget_rule(budget, error, match):
    """Floats in (0, 1] are fractions of the peak, ints and strings are sizes in bytes, at least 1 MB."""
    with pytest.raises(error, match=match):
        ActivationCheckpointing(memory_budget=budget)


def test_memory_budget_values_that_stay_valid():
    from lightning_memguard.core.checks import check_memory_budget

    assert check_memory_budget(1.0) == 1.0 and check_memory_budget(0.6) == 0.6 and check_memory_budget(5e-4) == 5e-4
    assert check_memory_budget(6 * 10**9) == 6 * 10**9 and check_memory_budget("1MB") == 10**6
    assert ActivationCheckpointing(memory_budget="6GB").memory_budget == "6GB"
