package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// Conditional changes of a runtime override (If-Match, If-None-Match) on
// two Caddy processes of one region, one Redis: the precondition holds
// across the region's nodes, not only on each node's own book.

// adminIfCall is one admin request with a precondition header, its
// status, ETag header and body; it waits on start before it is sent.
func adminIfCall(client *http.Client, admin int, method, path, body, header, value string, start <-chan struct{}) (int, string, string, error) {
	req, err := http.NewRequest(method, fmt.Sprintf("http://localhost:%d%s", admin, path), strings.NewReader(body))
	if err != nil {
		return 0, "", "", err
	}
	if header != "" {
		req.Header.Set(header, value)
	}
	if start != nil {
		<-start
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("ETag"), string(b), nil
}

// etagOn is the ETag of the override a node holds of id, "" without one.
func etagOn(t *testing.T, admin int, id string) string {
	t.Helper()
	s, etag, b, err := adminIfCall(http.DefaultClient, admin, http.MethodGet, "/ratelimit/overrides?zone=per_key&identifier="+urlQueryEscape(id), "", "", "", nil)
	switch {
	case err != nil:
		t.Fatal(err)
	case s == http.StatusNotFound:
		return ""
	case s != http.StatusOK:
		t.Fatalf("GET override: %d %s", s, b)
	}
	return etag
}

// regionETag is the ETag of what the region's Redis holds of id, "" for
// nothing or a removal.
func regionETag(rc *redis.Client, id string) string {
	raw, err := rc.HGet(context.Background(), "ratelimit:{overrides}", "per_key\x00"+id).Result()
	if err != nil {
		return ""
	}
	ver, val, _ := strings.Cut(raw, " ")
	var v struct {
		Region  string `json:"region"`
		Deleted bool   `json:"deleted"`
	}
	if json.Unmarshal([]byte(val), &v) != nil || v.Deleted {
		return ""
	}
	return `"` + ver + "." + v.Region + `"`
}

// TestOperator_TwoNodesConditionalChangesAtOnceOneWins: two operators read
// one override on two nodes of a region (one ETag) and each sends a
// conditional change to their node at the same moment, 20 times over for
// each of a PUT with If-Match, a DELETE with If-Match, and a PUT with
// If-None-Match: * creating the key. Exactly one takes (200); the other
// is a 412 (a DELETE whose node heard the removal before its check is a
// 404, which comes before any precondition), and the region and both
// nodes end on the winner's change. Before, each node checked its own
// book, which had not heard of the other's change: both took, the later
// version silently undoing the other.
func TestOperator_TwoNodesConditionalChangesAtOnceOneWins(t *testing.T) {
	srv := redisAndCaddy(t, "starts Caddy and Redis")
	global := fmt.Sprintf("\t\tregion eu-west-1\n\t\tredis %s\n\t\tfast_tick 10ms", srv.URL())
	nodes := []*node{startNode(t, global, operatorSite), startNode(t, global, operatorSite)}
	rc := srv.Client()
	clients := []*http.Client{{Timeout: 30 * time.Second}, {Timeout: 30 * time.Second}}
	const rounds = 20
	for _, c := range []struct {
		name, method, header string
		exists               bool
	}{
		{"PUT If-Match", http.MethodPut, "If-Match", true},
		{"DELETE If-Match", http.MethodDelete, "If-Match", true},
		{"PUT If-None-Match *", http.MethodPut, "If-None-Match", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			took := 0
			losers := map[string]int{} // who refused the losing change
			for round := range rounds {
				id := freshKey("cond")
				path := "/ratelimit/overrides?zone=per_key&identifier=" + urlQueryEscape(id)
				value := "*"
				if c.exists {
					s, etag, b, err := adminIfCall(http.DefaultClient, nodes[0].admin, http.MethodPut, path, `{"limit": 1}`, "", "", nil)
					if err != nil || s != http.StatusOK {
						t.Fatalf("%s round %d: the first PUT: %d %s %v", c.name, round, s, b, err)
					}
					redistest.Eventually(t, 10*time.Second, "both nodes hold the override read", func() bool { return etagOn(t, nodes[1].admin, id) == etag })
					value = etag
				}
				type answer struct {
					status     int
					etag, body string
					err        error
				}
				answers := make([]answer, len(nodes))
				start := make(chan struct{})
				var wg sync.WaitGroup
				for i, n := range nodes {
					wg.Add(1)
					go func() {
						defer wg.Done()
						a := &answers[i]
						a.status, a.etag, a.body, a.err = adminIfCall(clients[i], n.admin, c.method, path, fmt.Sprintf(`{"limit": %d}`, 100*(i+1)), c.header, value, start)
					}()
				}
				close(start)
				wg.Wait()
				winner := -1
				for i, a := range answers {
					switch {
					case a.err != nil:
						t.Fatalf("%s round %d, node %d: %v", c.name, round, i, a.err)
					case a.status == http.StatusOK && winner >= 0:
						t.Fatalf("%s round %d: both nodes took the change under %s %s: %d %s / %d %s", c.name, round, c.header, value,
							answers[0].status, strings.TrimSpace(answers[0].body), answers[1].status, strings.TrimSpace(answers[1].body))
					case a.status == http.StatusOK:
						winner = i
					case a.status == http.StatusPreconditionFailed, a.status == http.StatusNotFound && c.method == http.MethodDelete:
					default:
						t.Fatalf("%s round %d, node %d: %d %s, want 200 or 412", c.name, round, i, a.status, a.body)
					}
				}
				if winner < 0 {
					t.Fatalf("%s round %d: no node took the change: %+v", c.name, round, answers)
				}
				took++
				want := answers[winner].etag
				if c.method == http.MethodDelete {
					want = "" // a removal: no live override anywhere
				}
				redistest.EventuallyShow(t, 10*time.Second, "the region and both nodes on the winner's change", func() (bool, string) {
					r, a, b := regionETag(rc, id), etagOn(t, nodes[0].admin, id), etagOn(t, nodes[1].admin, id)
					return r == want && a == want && b == want, fmt.Sprintf("winner node %d (%s); the region holds %q, node 0 %q, node 1 %q", winner, want, r, a, b)
				})
				loser := answers[1-winner]
				switch {
				case strings.Contains(loser.body, "the region holds"):
					losers["the region's Redis"]++
				case loser.status == http.StatusNotFound:
					losers["its node (404: heard the removal)"]++
				default:
					losers["its node's book"]++
				}
				if round == 0 {
					t.Logf("%s: winner node %d; the other answered %d %s", c.name, winner, loser.status, strings.TrimSpace(loser.body))
				}
			}
			t.Logf("%s: one change of two took in each of %d rounds; the other was refused by %v", c.name, took, losers)
		})
	}
}
