from __future__ import annotations

import logging

from rtrain.supervisor.proc.gpu import (
    NO_GPU,
    DeviceMemory,
    GpuReading,
    NullReader,
    NvmlReader,
    ScriptedReader,
    wait_gpu_released,
)


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_scripted_reader_plays_readings_in_order_then_repeats_last():
    a, b = GpuReading((DeviceMemory(0, 1, 10),)), GpuReading(lost=True, detail="gone")
    reader = ScriptedReader([a, b])
    assert [reader.read({1}), reader.read({1}), reader.read({2})] == [a, b, b]
    assert reader.calls == [frozenset({1}), frozenset({1}), frozenset({2})]


def test_nvml_without_gpu_says_so_once_and_reads_nothing(caplog):
    caplog.set_level(logging.INFO, logger="rtrain.supervisor.proc.gpu")
    first, second = NvmlReader(), NvmlReader()
    if first.available:  # a machine with a GPU: the real reader must read it
        reading = first.read({1})
        assert reading.devices and reading.devices[0].total > 0
        return
    assert first.read({1}) == NO_GPU and second.read({1}) == NO_GPU
    said = [r for r in caplog.records if "GPU memory not watched" in r.getMessage()]
    assert len(said) <= 1  # at most once per process, even with several readers
    first.close()


def test_wait_gpu_released_until_memory_is_freed():
    held = GpuReading(process_memory={41: 5 << 30})
    reader = ScriptedReader([held, held, GpuReading()])
    t = FakeTime()
    assert wait_gpu_released(reader, [41], 10, clock=t.clock, sleep=t.sleep) == {}
    assert len(reader.calls) == 3


def test_wait_gpu_released_reports_holders_after_timeout():
    reader = ScriptedReader([GpuReading(process_memory={41: 7})])
    t = FakeTime()
    assert wait_gpu_released(reader, [41], 1.0, clock=t.clock, sleep=t.sleep) == {41: 7}
    assert t.now >= 1.0


def test_no_gpu_means_nothing_to_wait_for():
    assert wait_gpu_released(NullReader(), [1, 2], 10) == {}
