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
// slow Redis, as a saturated or far-away one looks to its clients. Cut
// makes it a black hole until Restore: a server behind a partition.
type Proxy struct {
	ln    net.Listener
	delay atomic.Int64 // nanoseconds
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns []net.Conn
	sent  atomic.Int64 // chunks the clients sent
	// upstream is where new connections go (SetUpstream).
	upstream atomic.Pointer[string]
	// cut is closed by Restore; nil while the path is whole. dropped are
	// the connections whose bytes a cut swallowed.
	cut     chan struct{}
	dropped map[net.Conn]bool
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
			p.wg.Add(1)
			go func() { defer p.wg.Done(); p.join(c) }()
		}
	}()
	t.Cleanup(p.Close)
	return p
}

// join connects c to the upstream once no cut holds the path: a client
// dialling through a partition sees its connection accepted and nothing
// answered, as a handshake's packets vanish.
func (p *Proxy) join(c net.Conn) {
	p.mu.Lock()
	p.conns = append(p.conns, c)
	cut := p.cut
	p.mu.Unlock()
	if cut != nil {
		<-cut
	}
	u, err := net.Dial("tcp", *p.upstream.Load())
	if err != nil {
		c.Close()
		return
	}
	p.mu.Lock()
	p.conns = append(p.conns, u)
	p.mu.Unlock()
	p.wg.Add(2)
	go func() { defer p.wg.Done(); p.copy(u, c, countingReader{c, &p.sent}, nil); u.Close() }()
	go func() { defer p.wg.Done(); p.copy(c, c, u, &p.delay); c.Close() }()
}

// copy forwards src to dst, holding each chunk for delay (nil: none); a
// chunk read while the path is cut is dropped and client (the
// connection's client end) marked, for Restore to close.
func (p *Proxy) copy(dst io.Writer, client net.Conn, src io.Reader, delay *atomic.Int64) {
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if delay != nil {
				time.Sleep(time.Duration(delay.Load()))
			}
			p.mu.Lock()
			cut := p.cut != nil
			if cut {
				p.dropped[client] = true
			}
			p.mu.Unlock()
			if !cut {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// Cut makes the path a black hole: every byte either way is swallowed
// and new connections are held unanswered, so that a client's calls end
// in its own timeouts, as behind a network partition (a stopped server
// refuses at once instead).
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut == nil {
		p.cut, p.dropped = make(chan struct{}), map[net.Conn]bool{}
	}
}

// Restore heals a cut: connections held go through, and those whose
// bytes the cut swallowed are closed (their clients have given up on
// them: what was lost leaves the stream out of step).
func (p *Proxy) Restore() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut == nil {
		return
	}
	for c := range p.dropped {
		c.Close()
	}
	close(p.cut)
	p.cut, p.dropped = nil, nil
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

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// URL returns a redis:// URL of the proxy.
func (p *Proxy) URL() string { return "redis://" + p.ln.Addr().String() }

// Close stops the proxy and its connections.
func (p *Proxy) Close() {
	p.Restore()
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
