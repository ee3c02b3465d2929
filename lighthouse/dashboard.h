// The dashboard page served at "/": one self-contained HTML file (no CDN, no external assets)
// that polls /status every second and draws every job's quorum and groups. A token, when the
// lighthouse needs one, is given in the page address as #token=...; it never leaves the browser
// except in the Authorization header of /status.
#pragma once

#include <string_view>

namespace lk::lighthouse {
std::string_view DashboardHtml();
}  // namespace lk::lighthouse
