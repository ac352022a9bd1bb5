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
	opt, err := redis.ParseURL(p.URL())
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opt)
	defer c.Close()
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
