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
// SetLatency makes it a long wire instead (a MySQL far from a region).
type Proxy struct {
	ln    net.Listener
	delay atomic.Int64 // nanoseconds
	// latency is the one-way time of the wire (SetLatency), nanoseconds.
	latency atomic.Int64
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []net.Conn
	sent    atomic.Int64 // chunks the clients sent
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
	if lat := time.Duration(p.latency.Load()); lat > 0 {
		go func() { defer p.wg.Done(); p.late(u, c, countingReader{c, &p.sent}, lat); u.Close() }()
		go func() { defer p.wg.Done(); p.late(c, c, u, lat); c.Close() }()
		return
	}
	go func() { defer p.wg.Done(); p.copy(u, c, countingReader{c, &p.sent}, nil); u.Close() }()
	go func() { defer p.wg.Done(); p.copy(c, c, u, &p.delay); c.Close() }()
}

// late forwards src to dst, each chunk lat after it was read, as a wire
// of that length carries it: the chunks behind it are not held longer
// (copy's delay holds each in turn, which a reply of several chunks pays
// several times). A cut swallows what is due while it lasts.
func (p *Proxy) late(dst io.Writer, client net.Conn, src io.Reader, lat time.Duration) {
	type chunk struct {
		b   []byte
		due time.Time
	}
	wire := make(chan chunk, 4096)
	done := make(chan struct{})
	go func() {
		defer close(done)
		failed := false
		for c := range wire {
			time.Sleep(time.Until(c.due))
			if !failed && !p.pass(client) {
				continue
			}
			if !failed {
				_, err := dst.Write(c.b)
				failed = err != nil // keep draining: the reader must not block
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			wire <- chunk{b: append([]byte(nil), buf[:n]...), due: time.Now().Add(lat)}
		}
		if err != nil {
			break
		}
	}
	close(wire)
	<-done
}

// pass reports whether a chunk of client's connection may go through
// now; while the path is cut it may not, and client is marked for
// Restore to close.
func (p *Proxy) pass(client net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut != nil {
		p.dropped[client] = true
		return false
	}
	return true
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

// SetLatency makes the connections made from now on a wire of lat each
// way (a round trip of 2 × lat), in place of the replies' delay: a
// server far away, whose clients' calls overlap on it as they do on a
// long link.
func (p *Proxy) SetLatency(lat time.Duration) { p.latency.Store(int64(lat)) }

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
