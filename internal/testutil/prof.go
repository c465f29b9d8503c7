package testutil

import (
	"os"
	"runtime/pprof"
	"syscall"
	"testing"
	"time"
)

// ProcessCPU is the process's CPU time so far (user and system, every
// thread): a benchmark's measure of work that another load on a shared
// machine stretches less than the wall time. Zero if getrusage fails.
func ProcessCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// StartCPUProfile writes a CPU profile of the process to path until stop
// is called, so a benchmark can profile one phase (not its setup). tb
// fails if the file cannot be created or a profile is already running.
func StartCPUProfile(tb testing.TB, path string) (stop func()) {
	tb.Helper()
	f, err := os.Create(path)
	if err != nil {
		tb.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		tb.Fatal(err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			tb.Error(err)
		}
	}
}
