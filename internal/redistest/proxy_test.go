package redistest

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestProxy_DelaysEveryReply: a call through the proxy takes at least its
// delay, and a changed delay applies to the next call.
func TestProxy_DelaysEveryReply(t *testing.T) {
	s := Start(t)
	p := StartDelayProxy(t, s.Addr(), 30*time.Millisecond)
	c := proxyClient(t, p)
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(t0); el < 30*time.Millisecond {
		t.Fatalf("a call through a 30 ms proxy took %s", el)
	}
	p.SetDelay(0)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
}

// TestProxy_CutSwallowsCallsUntilRestored: through a cut proxy a call on a
// connection made before ends in the caller's timeout, not in an error of
// the connection, and so does a new connection's first; once restored, a
// client's calls get through again.
func TestProxy_CutSwallowsCallsUntilRestored(t *testing.T) {
	s := Start(t)
	p := StartDelayProxy(t, s.Addr(), 0)
	opt, err := redis.ParseURL(p.URL())
	if err != nil {
		t.Fatal(err)
	}
	opt.MaxRetries, opt.ContextTimeoutEnabled = -1, true
	c := redis.NewClient(opt)
	defer c.Close()
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	p.Cut()
	fresh := redis.NewClient(opt)
	defer fresh.Close()
	for _, cl := range []*redis.Client{c, fresh} {
		tctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		t0 := time.Now()
		err := cl.Ping(tctx).Err()
		cancel()
		if el := time.Since(t0); err == nil || el < 200*time.Millisecond || el > 2*time.Second {
			t.Fatalf("a call through a cut proxy ended after %s with %v, want the caller's timeout of 200ms", time.Since(t0), err)
		}
	}
	p.Restore()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("after the restore: %v", err)
	}
}

// TestProxy_LatencyIsAWireEachWay: with a latency of 40 ms each way a call
// takes one round trip of 80 ms, and a pipeline of many commands (a reply
// of several chunks) still one, not one a chunk.
func TestProxy_LatencyIsAWireEachWay(t *testing.T) {
	s := Start(t)
	p := StartDelayProxy(t, s.Addr(), 0)
	p.SetLatency(40 * time.Millisecond)
	c := proxyClient(t, p)
	ctx := context.Background()
	if err := c.Set(ctx, "big", make([]byte, 256<<10), 0).Err(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(t0); el < 80*time.Millisecond || el > 150*time.Millisecond {
		t.Fatalf("a call over a wire of 40 ms each way took %s, want about 80 ms", el)
	}
	// The first pipeline grows the buffers on the way (about 250 ms
	// here, against 90 after): the second is timed.
	var el time.Duration
	for range 2 {
		t0 = time.Now()
		pipe := c.Pipeline()
		for range 8 {
			pipe.Get(ctx, "big")
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
		el = time.Since(t0)
	}
	if el > 200*time.Millisecond {
		t.Fatalf("a pipeline of 2 MB over a wire of 40 ms each way took %s, want about one round trip", el)
	}
}

// proxyClient is a client of the Redis behind p, through p, closed at the
// test's end.
func proxyClient(t *testing.T, p *Proxy) *redis.Client {
	t.Helper()
	opt, err := redis.ParseURL(p.URL())
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opt)
	t.Cleanup(func() { c.Close() })
	return c
}
