package redistest

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy is a TCP proxy in front of a server that delays every reply: a
// slow Redis, as a saturated or far-away one looks to its clients.
type Proxy struct {
	ln    net.Listener
	delay atomic.Int64 // nanoseconds
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns []net.Conn
	sent  atomic.Int64 // chunks the clients sent
	// upstream is where new connections go (SetUpstream).
	upstream atomic.Pointer[string]
}

// StartDelayProxy listens on a free loopback port and forwards to upstream
// (host:port), holding each chunk of the server's replies for delay. It
// stops at the end of the test.
func StartDelayProxy(t testing.TB, upstream string, delay time.Duration) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("delay proxy: %v", err)
	}
	p := &Proxy{ln: ln}
	p.delay.Store(int64(delay))
	p.upstream.Store(&upstream)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", *p.upstream.Load())
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, u)
			p.mu.Unlock()
			p.wg.Add(2)
			go func() { defer p.wg.Done(); _, _ = io.Copy(u, countingReader{c, &p.sent}); u.Close() }()
			go func() { defer p.wg.Done(); p.slowCopy(c, u); c.Close() }()
		}
	}()
	t.Cleanup(p.Close)
	return p
}

func (p *Proxy) slowCopy(dst, src net.Conn) {
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			time.Sleep(time.Duration(p.delay.Load()))
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// countingReader counts the reads that returned data.
type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	if n > 0 {
		c.n.Add(1)
	}
	return n, err
}

// Sent is how many chunks the clients have sent through the proxy: the
// round trips they made, where each waits for its answer before the next
// (a pipeline is one write, so one chunk on loopback).
func (p *Proxy) Sent() int64 { return p.sent.Load() }

// SetDelay changes the delay of later replies.
func (p *Proxy) SetDelay(d time.Duration) { p.delay.Store(int64(d)) }

// SetUpstream sends the connections made from now on to upstream
// (host:port); those made before stay with the server they reach, as
// after a DNS name moved to another server (a managed Redis's failover).
func (p *Proxy) SetUpstream(upstream string) { p.upstream.Store(&upstream) }

// URL returns a redis:// URL of the proxy.
func (p *Proxy) URL() string { return "redis://" + p.ln.Addr().String() }

// Close stops the proxy and its connections.
func (p *Proxy) Close() {
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
