"""The SSH test hosts, checked with the real ssh client."""

from __future__ import annotations

import subprocess

import pytest

from harness.sshhosts import TestHosts, available

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


def ssh(hosts: TestHosts, i: int, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(hosts.ssh_argv(i, *command), capture_output=True, text=True, timeout=30)


def open_session(hosts: TestHosts, i: int) -> subprocess.Popen[str]:
    """An ssh session to host i that stays open, returned once the remote side runs."""
    session = subprocess.Popen(
        hosts.ssh_argv(i, "echo up; exec sleep 60"), stdout=subprocess.PIPE, text=True
    )
    assert session.stdout is not None and session.stdout.readline() == "up\n"
    return session


def leftovers(hosts: TestHosts) -> list[str]:
    """Namespaces, interfaces and processes of this run that still exist."""
    namespaces = subprocess.check_output(["ip", "netns", "list"], text=True).splitlines()
    found = [ns for ns in namespaces if ns.startswith(f"fl-{hosts.run_id}-")]
    links = subprocess.check_output(["ip", "-o", "link"], text=True).splitlines()
    found += [line for line in links if hosts.bridge in line]
    procs = subprocess.check_output(["ps", "-eo", "pid,args"], text=True).splitlines()
    return found + [line for line in procs if str(hosts.dir) in line]


def test_each_host_answers_with_its_own_name_and_key():
    names = ["gpu-a100-0", "gpu-a100-1", "gpu-4090-0"]
    with TestHosts(3, names=names) as hosts:
        for i, name in enumerate(names):
            r = ssh(hosts, i, "hostname")
            assert (r.returncode, r.stdout.strip()) == (0, name), r.stderr
            assert hosts[i].host_key_line in hosts.known_hosts.read_text()
        assert len({h.address for h in hosts.hosts}) == 3


def test_installed_fake_command_runs_on_that_host_only():
    with TestHosts(2) as hosts:
        hosts.install(0, "nvidia-smi", "#!/bin/sh\necho 'NVIDIA A100-SXM4-80GB, 81920 MiB'\n")
        r = ssh(hosts, 0, "nvidia-smi")
        assert (r.returncode, r.stdout) == (0, "NVIDIA A100-SXM4-80GB, 81920 MiB\n"), r.stderr
        assert ssh(hosts, 1, "command -v nvidia-smi").returncode != 0


def test_stopped_host_refuses_and_comes_back():
    with TestHosts(2) as hosts:
        hosts.stop(1)
        r = ssh(hosts, 1, "true")
        assert r.returncode == 255 and "Connection refused" in r.stderr, r.stderr
        assert ssh(hosts, 0, "true").returncode == 0
        hosts.start(1)
        assert ssh(hosts, 1, "true").returncode == 0


def test_stop_ends_open_sessions():
    with TestHosts(1) as hosts:
        session = open_session(hosts, 0)
        hosts.stop(0)
        assert session.wait(timeout=10) == 255


def test_rekeyed_host_fails_strict_checking():
    with TestHosts(2) as hosts:
        old = hosts[0].host_key_line
        hosts.rekey(0)
        assert hosts[0].host_key_line != old
        r = ssh(hosts, 0, "true")
        assert r.returncode == 255 and "Host key verification failed" in r.stderr, r.stderr
        assert ssh(hosts, 1, "true").returncode == 0
        hosts.known_hosts.write_text(hosts[0].host_key_line + "\n")
        assert ssh(hosts, 0, "hostname").stdout == "host0\n"


def test_nothing_remains_after_exit_even_when_the_test_fails():
    with pytest.raises(AssertionError, match="the test failed"), TestHosts(3) as hosts:
        session = open_session(hosts, 2)
        assert leftovers(hosts)
        raise AssertionError("the test failed")
    assert session.wait(timeout=10) == 255
    assert leftovers(hosts) == []
    assert not hosts.dir.exists()


def test_nothing_remains_when_setup_fails_half_way():
    hosts = TestHosts(3, names=["ok-0", "ok-1", "x" * 80])  # longer than a hostname may be
    with pytest.raises(RuntimeError, match="exited"), hosts:
        pass
    assert leftovers(hosts) == []
    assert not hosts.dir.exists()
