package cniserver

import (
	"context"
	"errors"
	"fmt"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/ambientd/ambientd/nodeagent/unixsock"
)

// PeerCred is the identity of the process on the other end of a connection,
// as the kernel recorded it at connect(2) (SO_PEERCRED). It is the
// credentials.AuthInfo of every call the server handles.
type PeerCred struct {
	UID, GID uint32
	PID      int32
	credentials.CommonAuthInfo
}

// AuthType implements credentials.AuthInfo.
func (PeerCred) AuthType() string { return "peercred" }

// peerCredentials is a gRPC TransportCredentials for Unix sockets that does no
// wire handshake: it only reads the peer's SO_PEERCRED so the interceptors can
// refuse non-root callers with a status the caller can read (closing the
// connection in the handshake would leave the caller with an opaque EOF).
type peerCredentials struct{}

func (peerCredentials) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("cniserver: peer credentials are server-side only")
}

func (peerCredentials) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, nil, fmt.Errorf("peer credentials: %T is not a Unix socket connection", c)
	}
	cred, err := unixsock.PeerCred(uc)
	if err != nil {
		return nil, nil, err
	}
	return c, PeerCred{
		UID: cred.Uid, GID: cred.Gid, PID: cred.Pid,
		// A Unix socket between two processes on one host is as private as
		// the kernel: tell gRPC so, in case anything checks the level.
		CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity},
	}, nil
}

func (peerCredentials) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "peercred"}
}

func (p peerCredentials) Clone() credentials.TransportCredentials { return p }

func (peerCredentials) OverrideServerName(string) error { return nil }

// checkRoot returns a PermissionDenied status unless the caller is root.
func checkRoot(ctx context.Context) (PeerCred, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return PeerCred{}, status.Error(codes.PermissionDenied, "ambientd CNI socket: caller has no peer information")
	}
	cred, ok := p.AuthInfo.(PeerCred)
	if !ok {
		return PeerCred{}, status.Error(codes.PermissionDenied, "ambientd CNI socket: caller has no peer credentials")
	}
	if cred.UID != 0 {
		return cred, status.Errorf(codes.PermissionDenied, "ambientd CNI socket: peer uid %d (pid %d) is not root", cred.UID, cred.PID)
	}
	return cred, nil
}

func (s *Server) unaryRootOnly(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if cred, err := checkRoot(ctx); err != nil {
		s.log.Warn("refused CNI API call from non-root peer", "method", info.FullMethod, "uid", cred.UID, "pid", cred.PID)
		return nil, err
	}
	return handler(ctx, req)
}

func (s *Server) streamRootOnly(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if cred, err := checkRoot(ss.Context()); err != nil {
		s.log.Warn("refused CNI API stream from non-root peer", "method", info.FullMethod, "uid", cred.UID, "pid", cred.PID)
		return err
	}
	return handler(srv, ss)
}
