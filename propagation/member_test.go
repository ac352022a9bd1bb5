package propagation

import (
	"testing"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// TestMember_WorthPublishing: a cell is worth publishing once its region
// counted something and it is pressed (hot: half its limit or more), or
// its level reached publish_floor, or other regions count it too; a cell
// this region never counted, or never decided, is not.
func TestMember_WorthPublishing(t *testing.T) {
	p := &Propagator{cfg: Config{PublishFloor: 0.2}}
	for _, c := range []struct {
		name       string
		v          engine.CellView
		worth, hot bool
	}{
		{"idle", engine.CellView{Regional: 1, Effective: 1, Limit: 100}, false, false},
		{"at the floor", engine.CellView{Regional: 20, Effective: 20, Limit: 100}, true, false},
		{"pressed", engine.CellView{Regional: 10, Effective: 50, Limit: 100}, true, true},
		{"counted elsewhere too", engine.CellView{Regional: 1, Global: 1, Effective: 2, Limit: 100}, true, false},
		{"never counted here", engine.CellView{Global: 90, Effective: 90, Limit: 100}, false, false},
		{"no decision", engine.CellView{Regional: 50, Effective: 50}, false, false},
	} {
		worth, hot, _ := p.worth(&c.v)
		if worth != c.worth || hot != c.hot {
			t.Errorf("%s: worth %v hot %v, want %v %v", c.name, worth, hot, c.worth, c.hot)
		}
	}
}
