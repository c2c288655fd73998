"""The energy probe parses sysfs fixture trees (Documentation/ABI/testing/sysfs-class-power and
the powercap RAPL zones) into the right numbers, and says "not available" where it must."""

from __future__ import annotations

import os
import pathlib
import time

import pytest

from edgesync_bench import energy
from edgesync_bench.energy import EnergyProbe, read_power_supplies, read_rapl


def write_tree(root: pathlib.Path, files: dict[str, str | int]) -> None:
    """Write sysfs-like files (value + newline, as the kernel prints them) under root."""
    for rel, value in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")


PS = "sys/class/power_supply"
PC = "sys/class/powercap"


def phone(root, *, charge_uah=3_000_000, current_ua=-450_000, voltage_uv=3_900_000,
          status="Discharging", usb_online=0):
    """An Android phone: battery with charge_counter, a USB charger port, a BMS, and a
    peripheral's battery (scope Device) that must be ignored."""
    write_tree(root, {
        f"{PS}/battery/type": "Battery", f"{PS}/battery/status": status,
        f"{PS}/battery/current_now": current_ua, f"{PS}/battery/voltage_now": voltage_uv,
        f"{PS}/battery/charge_counter": charge_uah, f"{PS}/battery/capacity": 77,
        f"{PS}/usb/type": "USB", f"{PS}/usb/online": usb_online,
        f"{PS}/bms/type": "BMS", f"{PS}/bms/current_now": 123,
        f"{PS}/hid-stylus/type": "Battery", f"{PS}/hid-stylus/scope": "Device",
        f"{PS}/hid-stylus/status": "Discharging", f"{PS}/hid-stylus/charge_counter": 50_000,
        f"{PS}/hid-stylus/current_now": 9_000_000,
    })


def rapl(root, pkg_uj, dram_uj, *, core_uj=None, pkg_range=262_143_328_850,
         dram_range=65_712_999_613):
    files = {f"{PC}/intel-rapl:0/name": "package-0", f"{PC}/intel-rapl:0/energy_uj": pkg_uj,
             f"{PC}/intel-rapl:0/max_energy_range_uj": pkg_range,
             f"{PC}/intel-rapl:0:1/name": "dram", f"{PC}/intel-rapl:0:1/energy_uj": dram_uj,
             f"{PC}/intel-rapl:0:1/max_energy_range_uj": dram_range,
             f"{PC}/intel-rapl/enabled": 1}  # the control-type directory: not a zone
    if core_uj is not None:
        files |= {f"{PC}/intel-rapl:0:0/name": "core", f"{PC}/intel-rapl:0:0/energy_uj": core_uj,
                  f"{PC}/intel-rapl:0:0/max_energy_range_uj": pkg_range}
    write_tree(root, files)


def test_this_machine_has_no_source_and_says_so():
    have = [p for p in ("/sys/class/power_supply", "/sys/class/powercap")
            if os.path.isdir(p) and os.listdir(p)]
    if have:
        pytest.skip(f"this machine has energy sources: {have}")
    probe = EnergyProbe()
    assert probe.available() is False
    assert probe.reason.startswith("not available: ")
    assert "no system battery" in probe.reason and "intel-rapl" in probe.reason
    probe.start()
    m = probe.stop()
    assert m.available is False and m.reason.startswith("not available")
    assert (m.rapl, m.rapl_total_joules, m.battery_mah, m.battery_joules,
            m.mean_current_ma, m.mean_power_w, m.samples) == ((), None, None, None, None, None, 0)


def test_empty_root_is_not_available(tmp_path):
    probe = EnergyProbe(tmp_path)
    assert not probe.available()
    assert probe.reason == ("not available: no system battery under /sys/class/power_supply; "
                            "no readable /sys/class/powercap/intel-rapl:* energy_uj")


def test_phone_battery_parse(tmp_path):
    phone(tmp_path)
    supplies, problems = read_power_supplies(tmp_path)
    assert problems == []
    by = {s.name: s for s in supplies}
    assert [s.name for s in supplies] == ["battery", "bms", "hid-stylus", "usb"]
    b = by["battery"]
    assert (b.type, b.status, b.current_ua, b.voltage_uv, b.charge_counter_uah) == (
        "Battery", "Discharging", -450_000, 3_900_000, 3_000_000)
    assert b.energy_uwh is None and b.power_uw is None and b.is_system_battery
    assert not by["hid-stylus"].is_system_battery
    assert by["usb"].online == 0 and not by["usb"].is_external_online


def test_phone_discharging_measurement(tmp_path):
    phone(tmp_path, charge_uah=3_000_000, current_ua=-400_000)
    probe = EnergyProbe(tmp_path)
    assert probe.available()
    assert probe.reason == ("battery: battery (charge_counter, current_now); "
                            "no readable /sys/class/powercap/intel-rapl:* energy_uj")
    probe.start()
    # some drivers report the drain positive: magnitudes are averaged
    phone(tmp_path, charge_uah=2_987_500, current_ua=600_000, voltage_uv=3_800_000)
    probe.sample()
    phone(tmp_path, charge_uah=2_975_000, current_ua=-500_000, voltage_uv=3_700_000)
    m = probe.stop()
    assert m.available
    assert m.battery_mah == pytest.approx(25.0)
    assert m.battery_joules is None  # no energy_now on this phone
    assert m.samples == 3
    assert m.mean_current_ma == pytest.approx((400 + 600 + 500) / 3)
    assert m.mean_power_w == pytest.approx((0.4 * 3.9 + 0.6 * 3.8 + 0.5 * 3.7) / 3)
    assert m.rapl == () and m.rapl_total_joules is None
    assert m.seconds >= 0


def test_phone_plugged_in_mid_run_drops_battery_figures(tmp_path):
    phone(tmp_path)
    probe = EnergyProbe(tmp_path)
    probe.start()
    phone(tmp_path, charge_uah=2_990_000, usb_online=1, status="Charging")
    probe.sample()
    phone(tmp_path, charge_uah=2_980_000)
    m = probe.stop()
    assert not m.available and m.reason.startswith("not available")
    assert m.battery_mah is None and m.mean_current_ma is None and m.mean_power_w is None
    assert any("not discharging or external power" in n for n in m.notes)


def laptop_on_ac(root, energy_uwh=40_000_000):
    write_tree(root, {
        f"{PS}/AC/type": "Mains", f"{PS}/AC/online": 1,
        f"{PS}/BAT0/type": "Battery", f"{PS}/BAT0/status": "Charging",
        f"{PS}/BAT0/scope": "System", f"{PS}/BAT0/energy_now": energy_uwh,
        f"{PS}/BAT0/power_now": 15_000_000, f"{PS}/BAT0/voltage_now": 12_600_000,
    })


def test_laptop_on_ac_without_rapl_is_not_available(tmp_path):
    laptop_on_ac(tmp_path)
    probe = EnergyProbe(tmp_path)
    assert not probe.available()
    assert "battery not measuring: external power online (AC)" in probe.reason
    probe.start()
    laptop_on_ac(tmp_path, energy_uwh=41_000_000)
    m = probe.stop()
    assert not m.available
    assert m.battery_joules is None and m.mean_power_w is None


def test_laptop_on_battery_energy_now_and_power_now(tmp_path):
    laptop_on_ac(tmp_path)
    write_tree(tmp_path, {f"{PS}/AC/online": 0, f"{PS}/BAT0/status": "Discharging",
                          f"{PS}/BAT0/energy_now": 40_000_000})
    probe = EnergyProbe(tmp_path)
    assert probe.available()
    probe.start()
    write_tree(tmp_path, {f"{PS}/BAT0/energy_now": 39_990_000, f"{PS}/BAT0/power_now": 9_000_000})
    m = probe.stop()
    assert m.battery_joules == pytest.approx(10_000 * 3.6e-3)  # 10,000 µWh = 36 J
    assert m.mean_power_w == pytest.approx(12.0)  # power_now preferred over current x voltage
    assert m.battery_mah is None and m.mean_current_ma is None


def test_rapl_package_dram_and_wrap(tmp_path):
    rapl(tmp_path, pkg_uj=262_143_000_000, dram_uj=1_000_000, core_uj=5_000_000)
    readings, problems = read_rapl(tmp_path)
    assert problems == []
    assert [(r.zone, r.name, r.energy_uj, r.max_energy_range_uj) for r in readings] == [
        ("intel-rapl:0", "package-0", 262_143_000_000, 262_143_328_850),
        ("intel-rapl:0:0", "core", 5_000_000, 262_143_328_850),
        ("intel-rapl:0:1", "dram", 1_000_000, 65_712_999_613)]
    probe = EnergyProbe(tmp_path)
    assert probe.available()
    probe.start()
    # the package counter wraps: 328,850 µJ to the top of the range, then 2,671,150 µJ past 0
    rapl(tmp_path, pkg_uj=2_671_150, dram_uj=1_500_000, core_uj=6_000_000)
    m = probe.stop()
    assert m.available
    got = {r.name: (r.joules, r.wraps) for r in m.rapl}
    assert got["package-0"][0] == pytest.approx(3.0) and got["package-0"][1] == 1
    assert got["dram"] == (pytest.approx(0.5), 0)
    assert got["core"] == (pytest.approx(1.0), 0)
    assert m.rapl_total_joules == pytest.approx(3.5)  # package + dram; core is inside package
    assert any("1 counter wrap(s) corrected" in n for n in m.notes)


def test_rapl_two_wraps_counted_with_intermediate_samples(tmp_path):
    rng = 1_000_000
    rapl(tmp_path, pkg_uj=900_000, dram_uj=0, pkg_range=rng)
    probe = EnergyProbe(tmp_path)
    probe.start()
    for pkg in (100_000, 800_000, 50_000):  # +200k (wrap), +700k, +250k (wrap)
        rapl(tmp_path, pkg_uj=pkg, dram_uj=0, pkg_range=rng)
        probe.sample()
    m = probe.stop()
    pkg = next(r for r in m.rapl if r.name == "package-0")
    assert pkg.joules == pytest.approx(1.15) and pkg.wraps == 2


def test_rapl_wrap_without_range_is_not_guessed(tmp_path):
    rapl(tmp_path, pkg_uj=5_000_000, dram_uj=10)
    (tmp_path / PC / "intel-rapl:0/max_energy_range_uj").unlink()
    probe = EnergyProbe(tmp_path)
    probe.start()
    rapl(tmp_path, pkg_uj=1_000, dram_uj=2_000_010)
    (tmp_path / PC / "intel-rapl:0/max_energy_range_uj").unlink()
    m = probe.stop()
    got = {r.name: r.joules for r in m.rapl}
    assert got["package-0"] is None and got["dram"] == pytest.approx(2.0)
    assert m.rapl_total_joules is None  # a summed domain is unknown: no total
    assert m.available  # dram's joules are a real number
    assert any("counter went down with no max_energy_range_uj" in n for n in m.notes)


def test_malformed_and_missing_files(tmp_path):
    phone(tmp_path)
    write_tree(tmp_path, {f"{PS}/battery/current_now": "abc", f"{PS}/battery/voltage_now": "",
                          f"{PC}/intel-rapl:0/name": "package-0",
                          f"{PC}/intel-rapl:0/energy_uj": "12.5e3",
                          f"{PC}/intel-rapl:1/name": "package-1",
                          f"{PC}/intel-rapl:1/max_energy_range_uj": "x",
                          f"{PC}/intel-rapl:2/energy_uj": 7_000,
                          f"{PC}/intel-rapl:2/max_energy_range_uj": "junk"})
    supplies, problems = read_power_supplies(tmp_path)
    b = next(s for s in supplies if s.name == "battery")
    assert b.current_ua is None and b.voltage_uv is None and b.charge_counter_uah == 3_000_000
    assert problems == ["battery/current_now: malformed value 'abc'",
                        "battery/voltage_now: malformed value ''"]
    readings, problems = read_rapl(tmp_path)
    # zone 2 has no name file: its directory name stands in; its junk range means "unknown"
    assert readings == [energy.RaplReading("intel-rapl:2", "intel-rapl:2", 7_000, None)]
    assert problems == ["intel-rapl:0/energy_uj: malformed value '12.5e3'",
                        "intel-rapl:1/energy_uj: missing",
                        "intel-rapl:1/max_energy_range_uj: malformed value 'x'",
                        "intel-rapl:2/max_energy_range_uj: malformed value 'junk'"]
    probe = EnergyProbe(tmp_path)
    assert probe.available()
    assert "intel-rapl:0/energy_uj: malformed value '12.5e3'" in probe.reason


@pytest.fixture
def enforce_read_bits(monkeypatch):
    """Root reads a mode-000 file anyway: emulate the kernel's check for a non-root reader."""
    real = pathlib.Path.read_text

    def read_text(self, *args, **kwargs):
        if os.stat(self).st_mode & 0o444 == 0:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)


def test_rapl_permission_denied_is_reported(tmp_path, enforce_read_bits):
    rapl(tmp_path, pkg_uj=1_000, dram_uj=2_000)
    for zone in ("intel-rapl:0", "intel-rapl:0:1"):
        os.chmod(tmp_path / PC / zone / "energy_uj", 0)
    readings, problems = read_rapl(tmp_path)
    assert readings == []
    assert len(problems) == 2
    assert problems[0].startswith("intel-rapl:0/energy_uj: permission denied (energy_uj is "
                                  "readable by root only since the November 2020 fix for "
                                  "CVE-2020-8694")
    probe = EnergyProbe(tmp_path)
    assert not probe.available()
    assert probe.reason.startswith("not available: no system battery")
    assert "CVE-2020-8694" in probe.reason


def test_rapl_denied_but_battery_measures(tmp_path, enforce_read_bits):
    rapl(tmp_path, pkg_uj=1_000, dram_uj=2_000)
    os.chmod(tmp_path / PC / "intel-rapl:0" / "energy_uj", 0)
    phone(tmp_path)
    probe = EnergyProbe(tmp_path)
    assert probe.available()
    probe.start()
    phone(tmp_path, charge_uah=2_999_000)
    os.chmod(tmp_path / PC / "intel-rapl:0" / "energy_uj", 0o644)
    rapl(tmp_path, pkg_uj=9_000, dram_uj=3_000)
    os.chmod(tmp_path / PC / "intel-rapl:0" / "energy_uj", 0)
    m = probe.stop()
    assert m.battery_mah == pytest.approx(1.0)
    assert [(r.name, r.joules) for r in m.rapl] == [("dram", pytest.approx(0.001))]
    assert m.rapl_total_joules == pytest.approx(0.001)


def test_background_sampling_thread(tmp_path):
    phone(tmp_path, current_ua=-250_000)
    probe = EnergyProbe(tmp_path, interval_s=0.005)
    probe.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.02)
        with probe._lock:
            if len(probe._cur_ma) >= 4:
                break
    m = probe.stop()
    assert m.samples >= 5  # start + >= 3 thread samples + stop
    assert m.mean_current_ma == pytest.approx(250.0)
    assert probe._thread is None


def test_misuse_raises(tmp_path):
    probe = EnergyProbe(tmp_path)
    with pytest.raises(RuntimeError, match="without start"):
        probe.stop()
    probe.start()
    with pytest.raises(RuntimeError, match="twice"):
        probe.start()
    probe.stop()
    with pytest.raises(ValueError, match="interval_s"):
        EnergyProbe(tmp_path, interval_s=0)
