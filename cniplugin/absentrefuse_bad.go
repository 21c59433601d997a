//go:build ambientd_absent_refuse

package cniplugin

// refuseAbsent, in a build with the tag ambientd_absent_refuse only, is a
// known-bad plugin for the soak to catch (docs/soak.md, "Proving the soak
// fails"): while no agent answers it refuses every pod, pods outside the
// mesh too, although the API could tell it they need no agent. Never
// shipped: the default build has refuseAbsent false (absentrefuse.go).
const refuseAbsent = true
