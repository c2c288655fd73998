"""Energy probe: what the kernel says a stretch of work cost, or why it cannot say.

Two sources, read from sysfs under an injectable root (default ``/``; tests use fixture trees):

* **Intel RAPL** through the powercap framework (kernel ``Documentation/power/powercap/
  powercap.rst`` and ``Documentation/ABI/testing/sysfs-class-powercap``):
  ``/sys/class/powercap/intel-rapl:*/`` with ``name`` (``package-N``, ``core``, ``uncore``,
  ``dram``, ``psys``), ``energy_uj`` (cumulative energy counter, microjoules) and
  ``max_energy_range_uj`` (the counter's range, microjoules; it wraps to 0 past it). Since the
  November 2020 fix for CVE-2020-8694 (PLATYPUS) ``energy_uj`` is mode 0400: readable by root
  only. AMD CPUs with the RAPL powercap driver appear under the same names.
* **Power supplies** (kernel ``Documentation/ABI/testing/sysfs-class-power``):
  ``/sys/class/power_supply/<name>/`` with ``type`` (``Battery``, ``Mains``, ``USB``, ...),
  ``status`` (``Charging``, ``Discharging``, ``Not charging``, ``Full``, ``Unknown``),
  ``online`` (1 when an external supply delivers power), ``scope`` (``Device`` for a peripheral's
  battery), ``current_now`` (microamps), ``voltage_now`` (microvolts), ``charge_counter``
  (microampere-hours; Android phones expose it), ``energy_now`` (microwatt-hours) and
  ``power_now`` (microwatts; ACPI laptop batteries expose these two).

A measurement reports only what was read (no figure is ever estimated from a model):

* ``rapl`` per domain joules and ``rapl_total_joules`` = package domains + ``dram`` (the core
  and uncore domains are parts of the package's energy; ``psys`` covers the whole platform and
  would count both twice, so it is reported but not summed);
* from system batteries, only while one discharges, none charges and no external supply is
  online (a battery on AC does not measure what the machine draws; a second, idle battery that
  reports ``Not charging`` or ``Full`` is fine): ``battery_mah`` drawn (``charge_counter`` start
  minus stop), ``battery_joules`` (``energy_now`` start minus stop), and the mean of the
  ``current_now`` / ``power_now`` (or current x voltage) samples as mA and W. The sign of
  ``current_now`` differs between drivers (the ABI now says negative while discharging; many
  Android drivers report a positive drain), so magnitudes are averaged. Some vendor kernels
  report ``current_now`` in mA despite the ABI; the probe cannot tell and does not guess.

Samples are taken at ``start()``, ``stop()``, each ``sample()`` and, with ``interval_s``, by a
background thread. RAPL deltas are summed sample to sample, so several wraps are counted right
if samples come more often than once per wrap; with start and stop only, at most one wrap is.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

POWER_SUPPLY_DIR = "sys/class/power_supply"
POWERCAP_DIR = "sys/class/powercap"
RAPL_GLOB = "intel-rapl:*"
_RAPL_DENIED_HINT = ("permission denied (energy_uj is readable by root only since the November "
                     "2020 fix for CVE-2020-8694; run as root or grant read access)")
_SUPPLY_INTS = {"current_now": "current_ua", "voltage_now": "voltage_uv",
                "charge_counter": "charge_counter_uah", "energy_now": "energy_uwh",
                "power_now": "power_uw", "online": "online"}
_BATTERY_COUNTERS = ("charge_counter", "energy_now", "current_now", "power_now")


def _read(path: Path, problems: list[str], label: str) -> str | None:
    """The stripped text of a sysfs file; None (and a problem noted, unless it is simply
    absent) when it cannot be read."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None
    except PermissionError:
        problems.append(f"{label}: permission denied")
        return None
    except OSError as exc:  # e.g. EIO/ENODATA from a fuel gauge that is asleep
        problems.append(f"{label}: {exc.strerror or exc}")
        return None


def _read_int(path: Path, problems: list[str], label: str) -> int | None:
    """A sysfs integer attribute; None when absent, unreadable or malformed (problem noted)."""
    text = _read(path, problems, label)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        problems.append(f"{label}: malformed value {text[:40]!r}")
        return None


@dataclass(frozen=True)
class SupplyReading:
    """One ``/sys/class/power_supply/<name>/`` entry at one instant. Numeric fields are the raw
    sysfs integers in the ABI's units (µA, µV, µAh, µWh, µW); None when absent or unreadable."""

    name: str
    type: str | None = None
    status: str | None = None
    scope: str | None = None
    online: int | None = None
    current_ua: int | None = None
    voltage_uv: int | None = None
    charge_counter_uah: int | None = None
    energy_uwh: int | None = None
    power_uw: int | None = None

    @property
    def is_system_battery(self) -> bool:
        """A battery that powers this machine (``type`` Battery, ``scope`` not Device)."""
        return self.type == "Battery" and self.scope != "Device"

    def counters(self) -> list[str]:
        """The readable ones of charge_counter, energy_now, current_now, power_now."""
        return [c for c in _BATTERY_COUNTERS if getattr(self, _SUPPLY_INTS[c]) is not None]

    @property
    def is_external_online(self) -> bool:
        """A non-battery supply (Mains, USB, Wireless, ...) that reports ``online`` = 1."""
        return self.type != "Battery" and bool(self.online)


@dataclass(frozen=True)
class RaplReading:
    """One RAPL powercap zone at one instant: ``zone`` is the directory (``intel-rapl:0:1``),
    ``name`` its domain, ``energy_uj`` the counter (µJ), ``max_energy_range_uj`` its range (µJ;
    None when absent or malformed: a wrap then cannot be corrected)."""

    zone: str
    name: str
    energy_uj: int
    max_energy_range_uj: int | None


@dataclass(frozen=True)
class Snapshot:
    """All readable sources at ``t`` (``time.monotonic()`` seconds), plus every problem met
    (unreadable or malformed files), one human-readable string each."""

    t: float
    supplies: tuple[SupplyReading, ...]
    rapl: tuple[RaplReading, ...]
    problems: tuple[str, ...]


def read_power_supplies(root: str | os.PathLike = "/") -> tuple[list[SupplyReading], list[str]]:
    """Parse every ``<root>/sys/class/power_supply/*`` entry (sorted by name).

    Returns (readings, problems); a missing class directory gives ([], []). Never raises for
    unreadable or malformed attributes: the field is None and the problem is listed.
    """
    base = Path(root) / POWER_SUPPLY_DIR
    problems: list[str] = []
    if not base.is_dir():
        return [], problems
    readings = []
    for entry in sorted(base.iterdir(), key=lambda p: p.name):
        if not entry.is_dir():
            continue
        values: dict = {"name": entry.name}
        for attr in ("type", "status", "scope"):
            values[attr] = _read(entry / attr, problems, f"{entry.name}/{attr}") or None
        for attr, fld in _SUPPLY_INTS.items():
            values[fld] = _read_int(entry / attr, problems, f"{entry.name}/{attr}")
        readings.append(SupplyReading(**values))
    return readings, problems


def read_rapl(root: str | os.PathLike = "/") -> tuple[list[RaplReading], list[str]]:
    """Parse every ``<root>/sys/class/powercap/intel-rapl:*`` zone (sorted by zone).

    Returns (readings, problems). A zone whose ``energy_uj`` is missing, malformed or unreadable
    (root-only since CVE-2020-8694) is left out and named in problems; a missing ``name`` falls
    back to the zone directory's name.
    """
    base = Path(root) / POWERCAP_DIR
    problems: list[str] = []
    if not base.is_dir():
        return [], problems
    readings = []
    for zone in sorted(base.glob(RAPL_GLOB), key=lambda p: p.name):
        local: list[str] = []
        name = _read(zone / "name", local, f"{zone.name}/name") or zone.name
        energy = _read_int(zone / "energy_uj", local, f"{zone.name}/energy_uj")
        if energy is None and not (zone / "energy_uj").exists():
            local.append(f"{zone.name}/energy_uj: missing")
        rng = _read_int(zone / "max_energy_range_uj", local, f"{zone.name}/max_energy_range_uj")
        problems.extend(p.replace("permission denied", _RAPL_DENIED_HINT)
                        if p.endswith("energy_uj: permission denied") else p for p in local)
        if energy is not None:
            readings.append(RaplReading(zone.name, name, energy, rng if rng and rng > 0 else None))
    return readings, problems


def take_snapshot(root: str | os.PathLike = "/") -> Snapshot:
    """Read both sources once (see :func:`read_power_supplies` and :func:`read_rapl`)."""
    supplies, p1 = read_power_supplies(root)
    rapl, p2 = read_rapl(root)
    return Snapshot(time.monotonic(), tuple(supplies), tuple(rapl), tuple(p1 + p2))


def describe(snap: Snapshot) -> tuple[list[str], str]:
    """(sources usable for a measurement, a one-line reason) for one snapshot.

    Sources are ``"rapl"`` (at least one readable zone) and ``"battery"`` (a system battery
    with a readable counter, one discharging, none charging, no external supply online).
    """
    sources, parts = [], []
    if snap.rapl:
        sources.append("rapl")
        parts.append("RAPL: " + ", ".join(f"{r.name} ({r.zone})" for r in snap.rapl))
    batteries = [s for s in snap.supplies if s.is_system_battery]
    external = [s.name for s in snap.supplies if s.is_external_online]
    counted = [b for b in batteries if b.counters()]
    charging = [b.name for b in batteries if b.status == "Charging"]
    if (counted and not external and not charging
            and any(b.status == "Discharging" for b in counted)):
        sources.append("battery")
        parts.append("battery: " + ", ".join(f"{b.name} ({', '.join(b.counters())})"
                                             for b in counted))
    elif counted:
        why = (f"external power online ({', '.join(external)})" if external else
               "status " + ", ".join(f"{b.name}={b.status}" for b in counted))
        parts.append(f"battery not measuring: {why}")
    elif not batteries:
        parts.append(f"no system battery under /{POWER_SUPPLY_DIR}")
    else:
        parts.append("battery without readable counters: " + ", ".join(b.name for b in batteries))
    if not snap.rapl:
        parts.append(f"no readable /{POWERCAP_DIR}/{RAPL_GLOB} energy_uj")
    parts.extend(snap.problems)
    reason = "; ".join(parts)
    return sources, (reason if sources else "not available: " + reason)


@dataclass(frozen=True)
class RaplEnergy:
    """Energy of one RAPL zone over a measurement: joules (None when a wrap could not be
    corrected or the zone vanished), and how many wraps were corrected."""

    zone: str
    name: str
    joules: float | None
    wraps: int


@dataclass
class EnergyMeasurement:
    """What one ``start()``..``stop()`` stretch cost, as the kernel reports it.

    ``available`` is True when at least one figure below is a number; ``reason`` names the
    sources used or why there are none. ``seconds`` is wall time (monotonic). RAPL figures in
    joules; ``battery_mah`` drawn (negative if charge rose), ``battery_joules`` from
    ``energy_now``; ``mean_current_ma`` / ``mean_power_w`` over ``samples`` battery samples.
    ``notes`` explain every figure left out.
    """

    available: bool
    reason: str
    seconds: float
    rapl: tuple[RaplEnergy, ...] = ()
    rapl_total_joules: float | None = None
    battery_mah: float | None = None
    battery_joules: float | None = None
    mean_current_ma: float | None = None
    mean_power_w: float | None = None
    samples: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)


def _wrap_delta(prev: RaplReading, cur: RaplReading) -> tuple[int | None, bool]:
    """Counter increase from prev to cur (µJ) and whether it wrapped; None when it went down and
    the range is unknown. Off by at most one counter unit at a wrap."""
    if cur.energy_uj >= prev.energy_uj:
        return cur.energy_uj - prev.energy_uj, False
    rng = cur.max_energy_range_uj or prev.max_energy_range_uj
    if rng is None:
        return None, True
    return cur.energy_uj + rng - prev.energy_uj, True


class EnergyProbe:
    """Measure the energy of a stretch of work from sysfs (see the module docstring).

    ``EnergyProbe(root="/", interval_s=None)``: ``root`` is the directory holding ``sys/``;
    ``interval_s`` (seconds, > 0) starts a daemon thread that samples while measuring.
    Usage: ``if probe.available(): ...``; ``probe.start()``; work; ``m = probe.stop()``.
    ``start()`` and ``stop()`` also work where nothing is available: the measurement then says
    so (``available`` False, ``reason``) and holds no number. Thread-safe.
    """

    def __init__(self, root: str | os.PathLike = "/", interval_s: float | None = None) -> None:
        if interval_s is not None and not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        self.root = Path(root)
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._reason = ""
        self._running = False
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    def available(self) -> bool:
        """Rescan sysfs; True when RAPL or a discharging system battery can be measured."""
        sources, self._reason = describe(take_snapshot(self.root))
        return bool(sources)

    @property
    def reason(self) -> str:
        """The sources found, or why there are none, as of the last ``available()``/``stop()``."""
        if not self._reason:
            self.available()
        return self._reason

    def start(self) -> None:
        """Begin a measurement (takes the first sample). Raises RuntimeError if one is running."""
        with self._lock:
            if self._running:
                raise RuntimeError("EnergyProbe.start() called twice without stop()")
            self._running = True
            self._t0 = time.monotonic()
            self._first: Snapshot | None = None
            self._last_rapl: dict[str, RaplReading] = {}
            self._uj: dict[str, int | None] = {}
            self._wraps: dict[str, int] = {}
            self._names: dict[str, str] = {}
            self._notes: list[str] = []
            self._cur_ma: list[float] = []
            self._pow_w: list[float] = []
            self._battery_invalid = False
            self._sample_locked()
        if self.interval_s is not None:
            self._stop_event.clear()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """Take one sample now (no-op when not measuring)."""
        with self._lock:
            if self._running:
                self._sample_locked()

    def _sample_locked(self) -> None:
        snap = take_snapshot(self.root)
        if self._first is None:
            self._first = snap
            self._names = {r.zone: r.name for r in snap.rapl}
            self._uj = {r.zone: 0 for r in snap.rapl}
            self._wraps = {r.zone: 0 for r in snap.rapl}
        now = {r.zone: r for r in snap.rapl}
        for zone, prev in self._last_rapl.items():
            if self._uj.get(zone) is None:
                continue
            cur = now.get(zone)
            if cur is None:
                self._uj[zone] = None
                self._notes.append(f"RAPL {zone}: became unreadable during the measurement")
                continue
            delta, wrapped = _wrap_delta(prev, cur)
            if delta is None:
                self._uj[zone] = None
                self._notes.append(f"RAPL {zone}: counter went down with no max_energy_range_uj")
                continue
            self._uj[zone] += delta
            self._wraps[zone] += wrapped
        self._last_rapl = {z: r for z, r in now.items() if z in self._uj}
        self._snap = snap
        bats = [s for s in snap.supplies if s.is_system_battery]
        if (any(s.is_external_online for s in snap.supplies)
                or any(b.status == "Charging" for b in bats)):
            self._battery_invalid = True
        amps = [abs(b.current_ua) for b in bats if b.current_ua is not None]
        if amps:
            self._cur_ma.append(sum(amps) / 1e3)
        watts = []
        for b in bats:
            if b.power_uw is not None:
                watts.append(abs(b.power_uw) / 1e6)
            elif b.current_ua is not None and b.voltage_uv is not None:
                watts.append(abs(b.current_ua) * b.voltage_uv / 1e12)
        if watts:
            self._pow_w.append(sum(watts))

    def stop(self) -> EnergyMeasurement:
        """End the measurement (takes the last sample) and return it. Raises RuntimeError when
        no measurement is running."""
        if self._thread is not None:
            self._stop_event.set()
            self._thread.join()
            self._thread = None
        with self._lock:
            if not self._running:
                raise RuntimeError("EnergyProbe.stop() called without start()")
            self._sample_locked()
            self._running = False
            return self._result()

    def _result(self) -> EnergyMeasurement:
        first, last = self._first, self._snap
        notes = list(self._notes)
        seconds = last.t - self._t0
        rapl = tuple(RaplEnergy(z, self._names[z], None if uj is None else uj / 1e6,
                                self._wraps[z]) for z, uj in self._uj.items())
        for r in rapl:
            if r.wraps:
                notes.append(f"RAPL {r.zone} ({r.name}): {r.wraps} counter wrap(s) corrected")
        summed = [r for r in rapl if r.name.startswith("package") or r.name == "dram"]
        total = None
        if summed and all(r.joules is not None for r in summed):
            total = sum(r.joules for r in summed)
        mah = joules = mean_ma = mean_w = None
        samples = 0  # battery samples
        start_b = {s.name: s for s in first.supplies if s.is_system_battery}
        end_b = {s.name: s for s in last.supplies if s.is_system_battery}
        both = [n for n in start_b if n in end_b]
        discharging = (any(start_b[n].status == "Discharging" for n in both)
                       and any(end_b[n].status == "Discharging" for n in both))
        if both and (self._battery_invalid or not discharging):
            notes.append("battery figures left out: the battery was not discharging or external "
                         "power was online, so it did not measure what the machine drew")
        elif both:
            cc = [(start_b[n].charge_counter_uah, end_b[n].charge_counter_uah) for n in both]
            if all(a is not None and b is not None for a, b in cc):
                mah = sum(a - b for a, b in cc) / 1e3
            en = [(start_b[n].energy_uwh, end_b[n].energy_uwh) for n in both]
            if all(a is not None and b is not None for a, b in en):
                joules = sum(a - b for a, b in en) * 3.6e-3
            mean_ma = sum(self._cur_ma) / len(self._cur_ma) if self._cur_ma else None
            mean_w = sum(self._pow_w) / len(self._pow_w) if self._pow_w else None
            samples = max(len(self._cur_ma), len(self._pow_w))
        sources, reason = describe(last)
        available = any(v is not None for v in (total, mah, joules, mean_ma, mean_w)) or any(
            r.joules is not None for r in rapl)
        if not available and sources:
            reason = "not available: " + reason
        self._reason = reason
        log.debug("energy measurement over %.3f s: %s", seconds, reason)
        return EnergyMeasurement(available, reason, seconds, rapl, total, mah, joules, mean_ma,
                                 mean_w, samples, tuple(notes))
