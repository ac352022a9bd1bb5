//go:build unix

package freeport

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
)

// openLock opens the lock file shared by every test process, or returns nil.
func openLock() *os.File {
	f, err := os.OpenFile(filepath.Join(os.TempDir(), "caddy-ratelimit-test-ports.lock"), os.O_RDWR|os.O_CREATE, 0o666)
	if err != nil {
		return nil
	}
	return f
}

// tryLock takes the record lock of port p, without waiting.
func tryLock(p int) bool {
	fl := syscall.Flock_t{Type: syscall.F_WRLCK, Whence: 0, Start: int64(p), Len: 1}
	err := syscall.FcntlFlock(lock.Fd(), syscall.F_SETLK, &fl)
	return err == nil || !(errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EACCES))
}
