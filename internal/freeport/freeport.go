// Package freeport hands tests loopback TCP ports that stay theirs until the
// process ends.
//
// A port found by listening on port 0 and closing again is free only for a
// moment: the kernel hands the same ephemeral range to outgoing connections
// (a client's connection to Redis or MySQL takes one as its source port), and
// another test process running beside this one probes the same range. A
// server started on the port a moment later then fails with "address already
// in use". So a port comes from below the kernel's ephemeral range, which no
// outgoing connection takes, and is locked in a file every test process of
// this project shares (one byte per port, a POSIX record lock the kernel drops
// when the process ends), so no two processes hand out the same port. A port
// is handed out once per process.
//
// Where the ephemeral range leaves too little room below it, or the lock file
// cannot be opened, Port falls back to the kernel's choice.
package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

// lowest is the lowest port handed out: above the ports services commonly
// take.
const lowest = 10000

// minRoom is how many ports below the ephemeral range are needed to use
// them; with fewer the kernel's choice is as good.
const minRoom = 2000

// attempts bounds the search for a port in the range.
const attempts = 200

var (
	mu     sync.Mutex
	inited bool
	lock   *os.File // held open for the process's life: closing drops every lock
	top    int      // the first ephemeral port
	given  = map[int]bool{}
)

// Port returns a loopback TCP port that is free and that no other test
// process of this project will be handed while this one runs.
func Port() (int, error) {
	mu.Lock()
	defer mu.Unlock()
	if !inited {
		inited = true
		top = ephemeralLow()
		if top-lowest >= minRoom {
			lock = openLock()
		}
	}
	if lock == nil {
		return kernelPort()
	}
	for range attempts {
		p := lowest + rand.IntN(top-lowest)
		if given[p] || !tryLock(p) {
			continue
		}
		// Locked by no other process: is anything else listening?
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			continue // kept locked: it is not free for this process either
		}
		l.Close()
		given[p] = true
		return p, nil
	}
	return kernelPort()
}

// kernelPort is a port the kernel found free a moment ago.
func kernelPort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ephemeralLow is the first port of the kernel's ephemeral range (Linux's
// default when it cannot be read, which also stands for other systems).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil {
				return n
			}
		}
	}
	return 32768
}
