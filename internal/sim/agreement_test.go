package sim

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
)

// What the scale harness measured with real processes (`make regions`,
// integration/scale_test.go: 2 and 3 regions × 1, 2 and 4 nodes, limit
// 300, 80 req/s for 8 s, even and skewed; and the steady region of 400
// live keys), as the README reports it.
const (
	realAdmittedLo, realAdmittedHi = 1.03, 1.04 // admitted / limit, every size and scenario
	realPrimaryStatements          = 13.0       // MySQL statements/s on the primary
	realReplicaStatements          = 11.0       // per region that reads from the replica
	realSteadyStatements           = 10.0       // the steady region, whatever its nodes
	realSteadyRows                 = 40.0       // rows read/s, the same
)

// The agreement the simulator keeps with them: admitted within ± 3 % of
// the limit, MySQL within ± 25 %.
const (
	admittedSlack = 0.03
	mysqlSlack    = 0.25
)

func within(got, want, slack float64) bool { return math.Abs(got-want) <= slack*want }

// TestAgreement_ScaleHarnessLoads runs the harness's loads on the same
// sizes and checks the simulator's figures against the real processes'.
func TestAgreement_ScaleHarnessLoads(t *testing.T) {
	for _, regions := range []int{2, 3} {
		for _, nodes := range []int{1, 2, 4} {
			even := make([]int, regions)
			for i := range even {
				even[i] = 1
			}
			skew := map[int][]int{2: {7, 3}, 3: {6, 3, 1}}[regions]
			for _, sc := range []struct {
				name   string
				shares []int
			}{{"even", even}, {"skewed", skew}} {
				name := fmt.Sprintf("%dx%d/%s", regions, nodes, sc.name)
				t.Run(name, func(t *testing.T) {
					res, err := Run(HarnessLoad(regions, nodes, sc.shares))
					if err != nil {
						t.Fatal(err)
					}
					f := res.Figures()
					t.Logf("admitted/limit %.3f, MySQL statements/s %.1f + %.1f per replica region, Redis commands/s %.0f",
						f.Admitted, f.Statements, f.ReplicaStatements, f.Redis)
					if f.Admitted < realAdmittedLo-admittedSlack || f.Admitted > realAdmittedHi+admittedSlack {
						t.Errorf("admitted %.3f × the limit; the real processes admitted %.2f–%.2f (± %.2f)", f.Admitted, realAdmittedLo, realAdmittedHi, admittedSlack)
					}
					if !within(f.Statements, realPrimaryStatements, mysqlSlack) {
						t.Errorf("%.1f statements/s on the primary; real %.0f (± %.0f %%)", f.Statements, realPrimaryStatements, 100*mysqlSlack)
					}
					if !within(f.ReplicaStatements, realReplicaStatements, mysqlSlack) {
						t.Errorf("%.1f statements/s on the replica per region; real %.0f (± %.0f %%)", f.ReplicaStatements, realReplicaStatements, 100*mysqlSlack)
					}
					if res.Uncounted != 0 {
						t.Errorf("%d admitted units missing from their region's count", res.Uncounted)
					}
				})
			}
		}
	}
}

// TestAgreement_SteadyRegion runs the harness's steady region: MySQL's
// load follows regions, not nodes, and matches the real one's.
func TestAgreement_SteadyRegion(t *testing.T) {
	for _, nodes := range []int{1, 2, 4} {
		res, err := Run(HarnessSteady(nodes))
		if err != nil {
			t.Fatal(err)
		}
		f := res.Figures()
		t.Logf("%d nodes: %.1f statements/s, %.1f rows read/s", nodes, f.Statements, f.RowsRead)
		if !within(f.Statements, realSteadyStatements, mysqlSlack) || !within(f.RowsRead, realSteadyRows, mysqlSlack) {
			t.Errorf("%d nodes: %.1f statements/s and %.1f rows read/s; real %.0f and %.0f (± %.0f %%)",
				nodes, f.Statements, f.RowsRead, realSteadyStatements, realSteadyRows, 100*mysqlSlack)
		}
	}
}

// TestRun_SameSeedSameTable runs a small fleet twice and compares the
// printed tables byte for byte.
func TestRun_SameSeedSameTable(t *testing.T) {
	cfg := Config{Regions: 3, Nodes: 2, Keys: 2000, Hot: 4, Background: 100, Duration: 2 * time.Minute, Scenario: Skewed, Seed: 7}
	var out [2]string
	for i := range out {
		res, err := Run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		res.Print(&b)
		out[i] = b.String()
	}
	if out[0] != out[1] {
		t.Fatalf("one seed, two tables:\n%s\n---\n%s", out[0], out[1])
	}
	t.Log("\n" + out[0])
}
