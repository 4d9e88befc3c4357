#!/bin/sh
# Runs inside the Debian root that tests/pkg/test_install.sh boots with systemd-nspawn, as a
# oneshot unit once multi-user.target is up: embd.service under the real systemd, with every
# hardening setting of its unit applied (seccomp filter, namespaces, no capabilities). Each
# result is one "ok" or "FAIL" line of /var/log/embd-boot-check.log, which the host reads
# after the container powers itself off.
exec >/var/log/embd-boot-check.log 2>&1

check() {
	what=$1
	shift
	if "$@" >/tmp/check.out 2>&1; then
		echo "ok   $what"
	else
		echo "FAIL $what"
		sed 's/^/     /' /tmp/check.out | tail -20
	fi
}

# the main process's credentials and sandbox as the kernel sees them
sandboxed() {
	pid=$(systemctl show -p MainPID --value embd.service)
	uid=$(id -u embd)
	gid=$(id -g embd)
	grep -E '^(Uid|Gid|CapEff|CapBnd|NoNewPrivs|Seccomp):' "/proc/$pid/status"
	grep -Eq "^Uid:\s+$uid\s" "/proc/$pid/status" && grep -Eq "^Gid:\s+$gid\s" "/proc/$pid/status" &&
		grep -Eq '^CapEff:\s+0+$' "/proc/$pid/status" && grep -Eq '^CapBnd:\s+0+$' "/proc/$pid/status" &&
		grep -Eq '^NoNewPrivs:\s+1$' "/proc/$pid/status" && grep -Eq '^Seccomp:\s+2$' "/proc/$pid/status"
}

stopped_cleanly() {
	systemctl stop embd.service &&
		systemctl show -p Result -p ExecMainCode -p ExecMainStatus embd.service &&
		[ "$(systemctl show -p Result --value embd.service)" = success ] &&
		[ "$(systemctl show -p ExecMainStatus --value embd.service)" = 0 ]
}

as_trainer() {
	setpriv --reuid=trainer --regid=trainer --init-groups "$@"
}

check "systemctl start embd (Type=notify: started once the socket listens)" systemctl start embd.service
check "embd.service is active" systemctl is-active embd.service
check "embd runs as embd:embd, no capabilities, no new privileges, a seccomp filter" sandboxed
check "root's embctl status" embctl status
check "a member of group embd connects and makes a round trip" as_trainer /usr/local/bin/client_nop
check "a member of group embd takes a checkpoint into /var/lib/embd" as_trainer embctl checkpoint --wait
check "systemctl stop embd: Result=success, exit 0" stopped_cleanly
check "systemctl start embd restores the checkpoint" sh -c \
	'systemctl start embd.service && journalctl -u embd.service | grep "restored /var/lib/embd/step-"'
check "systemctl stop embd again" stopped_cleanly
echo "--- journal of embd.service"
journalctl -u embd.service --no-pager | tail -15
echo "boot_check: done"
systemctl poweroff --no-block
