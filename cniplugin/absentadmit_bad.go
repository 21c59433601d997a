//go:build ambientd_absent_admit

package cniplugin

// admitAbsent, in a build with the tag ambientd_absent_admit only, is a
// known-bad plugin for the soak to catch (docs/soak.md, "Proving the soak
// fails"): while no agent answers it lets every pod start, a pod in the
// mesh too, uncaptured. Never shipped: the default build has admitAbsent
// false (absentadmit.go).
const admitAbsent = true
