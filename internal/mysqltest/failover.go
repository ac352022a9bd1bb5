package mysqltest

import (
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
)

// Front is the address a DSN names in front of a primary and its replica:
// a TCP proxy that forwards to the primary until Failover, then to the
// promoted replica, as a virtual IP or a DNS name moves in a real
// failover. Connections open at the failover are cut.
type Front struct {
	ln     net.Listener
	mu     sync.Mutex
	target int
	conns  []net.Conn
	wg     sync.WaitGroup
}

// StartFront listens on a free loopback port in front of the pair's
// primary; it stops at the end of the test.
func (p *Pair) StartFront(t testing.TB) *Front {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("mysqltest: front: %v", err)
	}
	f := &Front{ln: ln, target: p.Primary.port}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			f.mu.Lock()
			target := f.target
			f.mu.Unlock()
			u, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", target))
			if err != nil {
				c.Close()
				continue
			}
			f.mu.Lock()
			f.conns = append(f.conns, c, u)
			f.mu.Unlock()
			f.wg.Add(2)
			go func() { defer f.wg.Done(); _, _ = io.Copy(u, c); u.Close() }()
			go func() { defer f.wg.Done(); _, _ = io.Copy(c, u); c.Close() }()
		}
	}()
	t.Cleanup(f.close)
	return f
}

// DSN is dsn (of the primary or the replica) with the front's address in
// place of the server's.
func (f *Front) DSN(dsn string) string {
	at := strings.Index(dsn, "tcp(")
	end := strings.Index(dsn, ")/")
	return dsn[:at] + "tcp(" + f.ln.Addr().String() + dsn[end:]
}

// Failover crashes the primary, promotes the replica (it stops
// replicating, with whatever it had applied, and takes writes) and moves
// the front to it.
func (f *Front) Failover(t testing.TB, p *Pair) {
	t.Helper()
	p.Primary.Stop()
	p.exec(t, "STOP SLAVE", "RESET SLAVE ALL", "SET GLOBAL read_only = 0")
	f.mu.Lock()
	f.target = p.Replica.port
	conns := f.conns
	f.conns = nil
	f.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

func (f *Front) close() {
	f.ln.Close()
	f.mu.Lock()
	for _, c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}
