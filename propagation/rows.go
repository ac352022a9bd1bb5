package propagation

import (
	"cmp"
	"strings"
)

// BlocklistRow is one row of ratelimit_blocklist: a region's counts of a
// cell and of the cell before it, at the cell's first denial there.
type BlocklistRow struct {
	Namespace  string `json:"namespace"`
	Identifier string `json:"identifier"`
	WindowMs   int64  `json:"window_ms"`
	Sequence   int64  `json:"sequence"`
	Region     string `json:"origin_region"`
	Limit      int64  `json:"limit_units"`
	CountCur   int64  `json:"count_cur"`
	CountPrev  int64  `json:"count_prev"`
	ExpiresMs  int64  `json:"expires_ms"`
	// UpdatedMs is when a count of the row last rose, on the database's
	// clock (0 in rows written before the column existed); set by the
	// database, never by a writer.
	UpdatedMs int64 `json:"updated_ms,omitempty"`
}

// CountRow is one row of ratelimit_global_counts: a region's count of a
// cell.
type CountRow struct {
	Namespace  string
	Identifier string
	WindowMs   int64
	Sequence   int64
	Region     string
	Count      int64
	// ResetVersion and ResetBase: the newest global reset the region
	// marked on the cell and its count then (0 and 0 for none); other
	// regions count Count − ResetBase once they mark the same reset.
	ResetVersion, ResetBase int64
	ExpiresMs               int64
	// UpdatedMs: as BlocklistRow's.
	UpdatedMs int64
}

// Cell names a cell as rows do: the identifier is the row's (its HMAC
// under identifier_secret).
type Cell struct {
	Namespace, Identifier string
	WindowMs, Sequence    int64
}

func (r *BlocklistRow) cell() Cell { return Cell{r.Namespace, r.Identifier, r.WindowMs, r.Sequence} }
func (r *CountRow) cell() Cell     { return Cell{r.Namespace, r.Identifier, r.WindowMs, r.Sequence} }

// expiresMs is when a cell's rows stop mattering: the end of the window
// after the cell's, where the cell last weighs as the previous one.
func expiresMs(seq, w int64) int64 { return (seq + 2) * w }

// RowKey is where a read of a table resumes: the unique key of the last
// row read, and its change time for reads in change order.
type RowKey struct {
	Namespace, Identifier string
	WindowMs, Sequence    int64
	Region                string
	UpdatedMs             int64
}

func (r *BlocklistRow) key() *RowKey {
	return &RowKey{r.Namespace, r.Identifier, r.WindowMs, r.Sequence, r.Region, r.UpdatedMs}
}

func (r *CountRow) key() *RowKey {
	return &RowKey{r.Namespace, r.Identifier, r.WindowMs, r.Sequence, r.Region, r.UpdatedMs}
}

func compareBlock(a, b *BlocklistRow) int { return compareKeys(a.key(), b.key()) }
func compareCount(a, b *CountRow) int     { return compareKeys(a.key(), b.key()) }

// compareKeys orders rows by their unique key, the order in which bulk
// upserts lock them.
func compareKeys(a, b *RowKey) int {
	return cmp.Or(strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Identifier, b.Identifier),
		cmp.Compare(a.WindowMs, b.WindowMs), cmp.Compare(a.Sequence, b.Sequence), strings.Compare(a.Region, b.Region))
}

// Table names one of the tables.
type Table int

// The tables.
const (
	Counts Table = iota
	Denials
	// Overrides holds the operators' runtime overrides (overrides.go).
	Overrides
	tables
)

// String is the table's name in the database.
func (t Table) String() string {
	switch t {
	case Denials:
		return "ratelimit_blocklist"
	case Overrides:
		return "ratelimit_overrides"
	}
	return "ratelimit_global_counts"
}

// regionColumn is the column that names the counting region.
func (t Table) regionColumn() string {
	if t == Denials || t == Overrides {
		return "origin_region"
	}
	return "region"
}

// what is the table's rows in log lines.
func (t Table) what() string {
	switch t {
	case Denials:
		return "denial rows"
	case Overrides:
		return "overrides"
	}
	return "published counts"
}
