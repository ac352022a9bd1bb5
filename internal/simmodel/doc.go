// Package simmodel holds in-process models of what the rate limiter talks
// to and this machine cannot run at edge scale: a region's Redis (the
// origin's scripts and the cross-region role's keys, with their exact
// semantics) and MySQL (one primary, a replica per region that lags, the
// two tables with their change column), each behind a Link that has a
// latency distribution, loss and outages on a simulated clock. The models
// count what the real servers would count: Redis commands (those a client
// sends and those the server runs, script bodies included), MySQL
// statements, rows read and rows written.
//
// The models implement the project's own interfaces (engine.Origin,
// propagation.Region, propagation.Store), so the engine and the
// propagation layer run unchanged on top of them: the simulator
// (internal/sim) and the multi-node reference test (internal/nodecheck)
// use them. Everything is deterministic given the order of calls and the
// seed: randomness comes from one seeded generator per model.
package simmodel
